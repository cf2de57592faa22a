"""What the store stored and removed, per tier, for the engines' KV-event streams.

The arena's books append to one bounded log as their state changes (a chunk becomes
servable in a tier, or leaves it), and so does each lower tier's, as a listener of its books
(:meth:`EventLog.tier_changed`, :mod:`kvtier.store.changes`); an engine client reads it
incrementally (:class:`~kvtier.protocol.Events`) and republishes it in its engine's own
event format, so routers that follow engine events see kvtier's tiers too::

    (seq, op, tier, namespace, key)      op: "stored" | "removed"

The log keeps the last ``capacity`` events; a reader that asks from before the oldest is told
it lost some (and resynchronises however its consumer does: vLLM's event stream has an
``AllBlocksCleared`` for that).
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import NamedTuple

from kvtier.keys import ChunkKey
from kvtier.store.changes import Change, TierChange

STORED = "stored"
REMOVED = "removed"


class Event(NamedTuple):
    seq: int
    op: str
    tier: str
    namespace: bytes
    key: ChunkKey


class EventLog:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self._events: deque[tuple[int, str, str, bytes, ChunkKey]] = deque(maxlen=capacity)
        """Plain tuples (made :class:`Event` when read): the garbage collector stops
        tracking them, so a full log is no work for its full collections."""
        self._seq = itertools.count(1)

    def add(self, op: str, tier: str, namespace: bytes, key: ChunkKey) -> None:
        self._events.append((next(self._seq), op, tier, namespace, key))

    def tier_changed(self, change: TierChange) -> None:
        """A lower tier's books changed: a chunk added is STORED there, one removed is
        REMOVED, whatever the change's origin (deletes and hits are not events)."""
        if change.change is Change.ADDED:
            self.add(STORED, change.tier, change.namespace, change.key)
        elif change.change is Change.REMOVED:
            self.add(REMOVED, change.tier, change.namespace, change.key)

    def since(self, seq: int, limit: int, namespace: bytes | None = None
              ) -> tuple[list[Event], int, bool]:
        """Events after ``seq`` (at most ``limit``, of ``namespace`` if given), the sequence
        to ask from next, and whether events after ``seq`` were already dropped."""
        events = self._events
        if not events:
            return [], seq, False
        first = events[0][0]
        lost = seq < first - 1
        start = max(0, seq - first + 1)
        out: list[Event] = []
        last = seq
        for i in range(start, len(events)):
            event = events[i]
            last = event[0]
            if namespace is None or event[3] == namespace:
                out.append(Event(*event))
                if len(out) >= limit:
                    break
        return out, last, lost

    @property
    def last_seq(self) -> int:
        return self._events[-1][0] if self._events else 0
