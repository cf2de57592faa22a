"""Least recently used: one ordered dict, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.policies.base import Algorithm, K


class LRU(Algorithm[K]):
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
