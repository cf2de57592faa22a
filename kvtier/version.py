"""The version of kvtier, in a module of its own: the server, the store and the CLI import it
without importing the whole package (``kvtier/__init__.py`` re-exports it)."""

from __future__ import annotations

__version__ = "0.1.0"
