"""Least recently used: keys oldest first, in a :class:`~kvtier.shards.EpochOrder`: a tier's
million keys never rehash in one go, nor cost a full garbage collection a visit each."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.policies.base import Algorithm, K
from kvtier.shards import EpochOrder


class LRU(Algorithm[K]):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: EpochOrder[K] = EpochOrder()

    def insert(self, key: K) -> None:
        self._order.add(key)

    def touch(self, key: K) -> None:
        self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.remove(key)

    def victims(self) -> Iterator[K]:
        return iter(self._order)

    def evicted(self, key: K) -> None:
        self._order.remove(key)

    def largest_table(self) -> int:
        return self._order.largest_shard()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class PlainLRU(Algorithm[K]):
    """LRU over one OrderedDict: a single-threaded replay's (the trace simulator's), where
    no lookup waits on a table's growth; the same order as :class:`LRU`."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        self._order[key] = None

    def touch(self, key: K) -> None:
        self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        del self._order[key]

    def victims(self) -> Iterator[K]:
        return iter(self._order)

    def evicted(self, key: K) -> None:
        del self._order[key]

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


LRU.plain = PlainLRU  # type: ignore[attr-defined]
