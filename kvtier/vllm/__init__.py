"""kvtier for vLLM: the KV connector and its copy path (``kvtier serve`` is :mod:`kvtier.launch`).

The only package of kvtier that imports vLLM and torch, and only when the connector is used:
``KvtierConnector`` is resolved lazily, so reading the connector's config (as ``kvtier serve``
does) stays light. vLLM loads it with ``kv_connector_module_path="kvtier.vllm"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.vllm.connector import KvtierConnector

__all__ = ["KvtierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvtierConnector":
        from kvtier.vllm.connector import KvtierConnector

        return KvtierConnector
    raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")
