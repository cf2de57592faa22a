"""The offline optimum (Belady's MIN) for one tier, under the same prefix-hit rule.

Knowing every future access, a full cache makes room by dropping the present block whose next
use is furthest away; a block whose own next use is further still is not stored at all
(bypass). Blocks are prefix-chained, so a block's next use never comes before its parent's:
MIN drops suffixes before their prefixes and keeps prefixes whole. Hits are counted exactly as
in the simulator (the contiguous present prefix at arrival), which makes MIN the ceiling line
for the policies of :mod:`kvtier.trace.simulate` at the same total capacity.
"""

from __future__ import annotations

import heapq

from kvtier.trace.formats import Request
from kvtier.trace.hits import HitCounts
from kvtier.trace.reuse import Accesses, flatten, next_use


def belady(
    requests: list[Request], capacity: int | None, accesses: Accesses | None = None
) -> HitCounts:
    """Prefix hits of an optimal cache of ``capacity`` chunks (``None``: unbounded)."""
    acc = accesses if accesses is not None else flatten(requests)
    return _Min(capacity, acc).run(requests)


class _Min:
    def __init__(self, capacity: int | None, acc: Accesses) -> None:
        self.capacity = capacity
        self.ids: list[int] = acc.ids.tolist()
        self.next: list[int] = next_use(acc.ids).tolist()
        self.present: dict[int, int] = {}
        """Block -> position of its next use."""
        self.heap: list[tuple[int, int]] = []
        """(-next use, block), with stale entries skipped lazily."""

    def run(self, requests: list[Request]) -> HitCounts:
        counts = HitCounts()
        start = 0
        for request in requests:
            end = start + len(request.blocks)
            prefix = start
            while prefix < end and self.ids[prefix] in self.present:
                prefix += 1
            for t in range(start, end):
                self._access(self.ids[t], self.next[t])
            counts.add(request, prefix - start)
            start = end
        return counts

    def _access(self, block: int, next_t: int) -> None:
        if block in self.present or self.capacity is None or len(self.present) < self.capacity:
            self._keep(block, next_t)
            return
        if self.capacity == 0:
            return
        furthest, victim = self._furthest()
        if next_t >= furthest:
            return  # bypass: the new block is needed no sooner than anything present
        heapq.heappop(self.heap)
        del self.present[victim]
        self._keep(block, next_t)

    def _keep(self, block: int, next_t: int) -> None:
        self.present[block] = next_t
        heapq.heappush(self.heap, (-next_t, block))

    def _furthest(self) -> tuple[int, int]:
        while True:
            neg_next, block = self.heap[0]
            if self.present.get(block) == -neg_next:
                return -neg_next, block
            heapq.heappop(self.heap)
