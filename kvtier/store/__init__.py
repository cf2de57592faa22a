"""The tiered store: what is cached where, kept correct, moved between tiers.

One arena (host RAM, shared with engine processes) on top, then the lower tiers in config
order. Every lower-tier hit is staged through the arena. The operations and the components
that own the state are described in :mod:`kvtier.store.core`.

The names below are imported on first use (PEP 562), so importing one pure module of the
package (``kvtier.store.placement``, which ``kvtier trace simulate`` drives) does not load
the store's runtime (the arena, threads, tiers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.core import ARENA, Hit, TieredStore

__all__ = ["ARENA", "Hit", "TieredStore"]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("kvtier.store.core"), name)
    raise AttributeError(f"module 'kvtier.store' has no attribute {name!r}")
