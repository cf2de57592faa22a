"""Per-chunk and per-lease records of the store (plain bookkeeping, no behaviour)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey


class Where(enum.Enum):
    """Where a chunk stands in the arena."""

    ABSENT = "absent"        # only in lower tiers
    RESERVED = "reserved"    # a client is writing its payload into ``slot``
    PROMOTING = "promoting"  # a lower tier is reading it into ``slot``
    READY = "ready"          # committed in ``slot``; servable


@dataclass
class Entry:
    key: ChunkKey
    priority: int
    where: Where = Where.ABSENT
    slot: int | None = None
    namespace_fp: bytes = b""
    tokens: int = 0
    payload_len: int = 0
    prefix_tokens: int = 0
    owner: int | None = None
    """Connection that reserved the slot (reservations die with it)."""
    deadline: float = 0.0
    """Reservations left unfinished past this time are aborted."""
    sealed: bool = False
    """The header page in the slot matches the payload (set before a lower-tier write)."""
    lower: set[str] = field(default_factory=set)
    """Lower tiers that hold a committed copy."""
    writing: set[str] = field(default_factory=set)
    """Lower tiers a copy is being written to now (the slot must stay put)."""
    reading: str | None = None
    """The lower tier a promotion reads from."""

    @property
    def stored(self) -> bool:
        return self.where is Where.READY or bool(self.lower)


class ItemState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


@dataclass
class LeaseItem:
    key: ChunkKey
    slot: int
    tier: str
    state: ItemState


@dataclass
class LeaseRecord:
    lease_id: int
    owner: int
    deadline: float
    items: list[LeaseItem]

    @property
    def done(self) -> bool:
        return all(item.state is not ItemState.PENDING for item in self.items)
