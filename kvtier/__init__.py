"""kvtier: a tiered KV cache for LLM serving engines.

The stable public names are re-exported here; the vLLM connector lives in ``kvtier.vllm``.
"""

from __future__ import annotations

__version__ = "0.1.0"

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
