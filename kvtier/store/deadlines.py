"""Items with a deadline, soonest first, so expiry costs what expired, not what is held.

A binary heap with lazy deletion: changing or removing a deadline leaves the old heap entry
behind, and it is skipped when it surfaces. The heap is rebuilt when stale entries outnumber
live ones, so memory stays within a small factor of the items held.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class Deadlines(Generic[T]):
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, T]] = []
        self._live: dict[T, tuple[float, int]] = {}
        self._seq = itertools.count()

    def set(self, item: T, deadline: float) -> None:
        """Give ``item`` this deadline (replacing any earlier one)."""
        seq = next(self._seq)
        self._live[item] = (deadline, seq)
        heapq.heappush(self._heap, (deadline, seq, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def get(self, item: T) -> float | None:
        found = self._live.get(item)
        return None if found is None else found[0]

    def pop_expired(self, now: float, limit: int | None = None) -> list[T]:
        """Remove and return the items whose deadline is at or before ``now`` (at most
        ``limit``, soonest first)."""
        out: list[T] = []
        heap = self._heap
        while heap and heap[0][0] <= now and (limit is None or len(out) < limit):
            deadline, seq, item = heapq.heappop(heap)
            if self._live.get(item) == (deadline, seq):
                del self._live[item]
                out.append(item)
        return out

    def _compact(self) -> None:
        self._heap = [(d, s, item) for item, (d, s) in self._live.items()]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: object) -> bool:
        return item in self._live

    def __iter__(self) -> Iterator[T]:
        return iter(self._live)
