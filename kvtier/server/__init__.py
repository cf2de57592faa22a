"""The node-level cache server (one per node, or embedded in a process)."""

from __future__ import annotations

from kvtier.server.node import EmbeddedServer, NodeServer

__all__ = ["EmbeddedServer", "NodeServer"]
