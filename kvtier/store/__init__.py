"""The tiered store: what is cached where, kept correct, moved between tiers.

One arena (host RAM, shared with engine processes) on top, then the lower tiers in config
order. Every lower-tier hit is staged through the arena. The operations and the components
that own the state are described in :mod:`kvtier.store.core`.
"""

from __future__ import annotations

from kvtier.store.core import ARENA, Hit, TieredStore

__all__ = ["ARENA", "Hit", "TieredStore"]
