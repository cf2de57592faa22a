"""The store's records: a chunk in an arena slot, and leases (plain data, no behaviour).

An :class:`Entry` exists exactly as long as its chunk holds an arena slot; what a lower tier
holds is in that tier's books (:mod:`kvtier.store.lower`), not here::

    (no entry) ──reserve──► RESERVED ──commit──► READY ──evicted / dropped──► (no entry)
        │                      └──abort / expiry──────────────────────────────►┘
        └──lease of a lower-tier chunk──► PROMOTING ──read done──► READY
                                              └──read failed──────────────────►┘
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey


class Where(enum.Enum):
    """What a chunk's arena slot holds now."""

    RESERVED = "reserved"    # a client is writing its payload into the slot
    PROMOTING = "promoting"  # a lower tier is reading it into the slot
    READY = "ready"          # committed; servable


@dataclass(slots=True)
class Entry:
    key: ChunkKey
    slot: int
    where: Where
    priority: int
    until: float | None = None
    """When ``priority`` falls back to the default (the store's clock); ``None``: never."""
    namespace_fp: bytes = b""
    tokens: int = 0
    payload_len: int = 0
    prefix_tokens: int = 0
    """Tokens of the whole prefix this chunk completes (admission rules look at it)."""
    sealed: bool = False
    """The header page in the slot matches the payload (set before a lower-tier write)."""
    writing: set[str] = field(default_factory=set)
    """Lower tiers a copy of the slot is being written to now (the slot must stay put)."""
    reading: str | None = None
    """PROMOTING: the lower tier the chunk is read from."""
    demoting: bool = False
    """Left the eviction order; the slot is freed when its write-back ends..."""
    rescued: bool = False
    """...unless a use started a write-through copy meanwhile: it rejoins the order then."""


class ItemState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass(slots=True)
class LeaseItem:
    key: ChunkKey
    slot: int
    tier: str
    state: ItemState


@dataclass(slots=True)
class LeaseRecord:
    lease_id: int
    owner: int
    items: list[LeaseItem]
    closed: bool = False

    @property
    def done(self) -> bool:
        return all(item.state is not ItemState.PENDING for item in self.items)
