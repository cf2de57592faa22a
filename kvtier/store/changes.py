"""What a lower tier's books announce when what the tier holds changes, and who listens.

A :class:`~kvtier.store.lower.LowerTierState` changes its books only through its own methods,
and each of those announces the change, under the store lock, to the listeners the store
subscribed when it was built (:meth:`~kvtier.store.lower.LowerTierState.subscribe`)::

    change    when                                            event log    journal (here only)
    ADDED     a chunk entered the books: written here,        STORED       "+" with its size
              found by a listing, or a peer's record                       and retention
    REMOVED   a chunk left the books: evicted, forgotten,     REMOVED      -
              found lost
    DELETED   this server removed the chunk's bytes: its      -            "-"
              delete ran, a read quarantined it, it was swept
    USED      a chunk was read from the tier (a hit)          -            "t"
    RETAINED  its retention was set here (held chunks,        -            "+" with it, if
              tail first)                                                  above the default

Every change says where it came from (:class:`Origin`): ``HERE`` (this server's own write,
eviction, delete or hit), ``PEER`` (another server's journal record) or ``LISTING`` (a listing
of the tier). The journal (:class:`~kvtier.store.sharing.Sharing`) publishes only what
happened ``HERE``, so what came from the other servers is never echoed back to them; the
event log records every origin (an engine's router wants to know what the tier holds,
whoever put it there). A touch (recency only) changes nothing a listener follows and is not
announced.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Protocol

from kvtier.keys import ChunkKey
from kvtier.policies.retention import DEFAULT_PRIORITY


class Change(enum.Enum):
    ADDED = "added"
    REMOVED = "removed"
    DELETED = "deleted"
    USED = "used"
    RETAINED = "retained"


class Origin(enum.Enum):
    HERE = "here"
    PEER = "peer"
    LISTING = "listing"


class TierChange(NamedTuple):
    change: Change
    origin: Origin
    tier: str
    key: ChunkKey
    namespace: bytes
    size: int = 0
    """The chunk's size in the tier (ADDED only)."""
    priority: int = DEFAULT_PRIORITY
    """Its retention priority in the tier's books (ADDED, RETAINED) ..."""
    until: float | None = None
    """... until then, on the store's clock (``None``: until changed)."""


class TierListener(Protocol):
    """Told every change of what a lower tier holds, under the store lock (it must not take
    the lock, block, or change the tier's books)."""

    def tier_changed(self, change: TierChange) -> None: ...
