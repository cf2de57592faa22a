"""kvtier: a tiered KV cache for LLM serving engines.

The stable public names are re-exported here, each imported on first use (PEP 562), so
``import kvtier`` (or any submodule) does not load the server and the store; the vLLM
connector lives in ``kvtier.vllm``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvtier.version import __version__

if TYPE_CHECKING:
    from kvtier.client import KvtierClient
    from kvtier.config import ArenaConfig, ServerConfig, TierConfig
    from kvtier.errors import (
        ClientError,
        ConfigError,
        CorruptChunkError,
        KvtierError,
        RequestRejected,
        ServerUnavailable,
        TierError,
    )
    from kvtier.keys import ChunkKey, Namespace, chunk_keys
    from kvtier.server import EmbeddedServer, NodeServer
    from kvtier.store import TieredStore

_EXPORTS = {
    "ArenaConfig": "kvtier.config",
    "ChunkKey": "kvtier.keys",
    "ClientError": "kvtier.errors",
    "ConfigError": "kvtier.errors",
    "CorruptChunkError": "kvtier.errors",
    "EmbeddedServer": "kvtier.server",
    "KvtierClient": "kvtier.client",
    "KvtierError": "kvtier.errors",
    "Namespace": "kvtier.keys",
    "NodeServer": "kvtier.server",
    "RequestRejected": "kvtier.errors",
    "ServerConfig": "kvtier.config",
    "ServerUnavailable": "kvtier.errors",
    "TierConfig": "kvtier.config",
    "TierError": "kvtier.errors",
    "TieredStore": "kvtier.store",
    "chunk_keys": "kvtier.keys",
}
"""Each public name and the module that defines it."""

__all__ = [
    "ArenaConfig",
    "ChunkKey",
    "ClientError",
    "ConfigError",
    "CorruptChunkError",
    "EmbeddedServer",
    "KvtierClient",
    "KvtierError",
    "Namespace",
    "NodeServer",
    "RequestRejected",
    "ServerConfig",
    "ServerUnavailable",
    "TierConfig",
    "TierError",
    "TieredStore",
    "__version__",
    "chunk_keys",
]


def __getattr__(name: str) -> object:
    """Import a public name's module on first use (then it is an ordinary attribute)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
