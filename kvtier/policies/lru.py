"""Least recently used: keys oldest first, in a :class:`~kvtier.shards.EpochOrder`: a tier's
million keys never rehash in one go, nor cost a full garbage collection a visit each."""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.policies.base import Algorithm, K
from kvtier.shards import EpochOrder, PlainOrder


class LRU(Algorithm[K]):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: EpochOrder[K] | PlainOrder[K] = EpochOrder()

    def unshard(self) -> None:
        assert not self._order
        self._order = PlainOrder()

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
