"""S3-FIFO (Yang et al., SOSP 2023): three FIFO queues, lazy promotion, quick demotion."""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterator

from kvtier.errors import IntegrityError
from kvtier.policies.base import Algorithm, K

MAX_FREQ = 3
"""Frequencies are 2-bit counters: hits beyond three are not told apart."""


class _Move(enum.Enum):
    PROMOTE = enum.auto()  # small -> tail of main (it was hit while in small)
    REQUEUE = enum.auto()  # head of main -> tail of main, one hit fewer
    EVICT = enum.auto()


class S3FIFO(Algorithm[K]):
    """S3-FIFO filters one-hit wonders through a small queue before they reach the main one.

    ::

        insert --> small (10% of capacity) --hit while in small--> main (the rest) --+
                     |                                              ^   |          |
                     | no hit: evicted, name kept                   |   +- hit: ---+
                     v                                              |  requeued, freq - 1
                   ghost (names, as many as main) --insert again----+

    Every key carries a 2-bit hit count. Victims come from the head of small while small
    holds at least its 10% share, else from the head of main. A small head that was hit moves
    to main instead of leaving; a main head that was hit is requeued with one hit fewer. A key
    whose name is still in ghost was evicted too early, so it is inserted straight into main.

    Those moves are lazy: :meth:`victims` only replays them on a view of the queues, and
    :meth:`evicted` applies the ones that came before the chosen key. Keys the caller skipped
    (protected) stay at the head of their queue, so the next eviction meets them first again.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small_target = max(1, self.capacity // 10)
        self._ghost_limit = max(1, self.capacity - self._small_target)
        self._small: OrderedDict[K, None] = OrderedDict()
        self._main: OrderedDict[K, None] = OrderedDict()
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._freq: dict[K, int] = {}

    @property
    def ghost_count(self) -> int:
        """Names of keys evicted from small and not seen since; at most the main share."""
        return len(self._ghost)

    def in_main(self, key: K) -> bool:
        """True if ``key`` is resident in the main queue (it survived the small one)."""
        return key in self._main

    def insert(self, key: K) -> None:
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def touch(self, key: K) -> None:
        self._freq[key] = min(MAX_FREQ, self._freq[key] + 1)

    def remove(self, key: K) -> None:
        # Not an eviction: the key left for another reason, so no ghost is kept.
        del self._freq[key]
        if key in self._small:
            del self._small[key]
        else:
            del self._main[key]

    def victims(self) -> Iterator[K]:
        return (key for move, key in self._plan() if move is _Move.EVICT)

    def evicted(self, key: K) -> None:
        steps: list[tuple[_Move, K]] = []
        for move, other in self._plan():
            if other == key and move is _Move.EVICT:
                break
            steps.append((move, other))
        for move, other in steps:
            if move is _Move.PROMOTE:
                del self._small[other]
                self._main[other] = None
            elif move is _Move.REQUEUE:
                self._main.move_to_end(other)
                self._freq[other] -= 1
        self._drop(key)

    def _drop(self, key: K) -> None:
        del self._freq[key]
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_limit:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def _plan(self) -> Iterator[tuple[_Move, K]]:
        """Every move repeated evictions would make until both queues are empty.

        Reads the queues without changing them: keys moved to main's tail wait in
        ``requeued`` with the hit count they would then have.
        """
        small, main = iter(self._small), iter(self._main)
        n_small, n_main = len(self._small), len(self._main)
        main_unread = n_main
        requeued: deque[tuple[K, int]] = deque()
        while n_small or n_main:
            if n_small and (n_small >= self._small_target or not n_main):
                key = next(small)
                n_small -= 1
                if self._freq[key]:
                    requeued.append((key, self._freq[key]))
                    n_main += 1
                    yield _Move.PROMOTE, key
                else:
                    yield _Move.EVICT, key
                continue
            if main_unread:
                key = next(main)
                freq = self._freq[key]
                main_unread -= 1
            else:
                key, freq = requeued.popleft()
            if freq:
                requeued.append((key, freq - 1))
                yield _Move.REQUEUE, key
            else:
                n_main -= 1
                yield _Move.EVICT, key

    def check_integrity(self) -> None:
        """Raise IntegrityError if queues overlap, counts drift, or ghost outgrows its bound."""
        residents = self._small.keys() | self._main.keys()
        if len(residents) != len(self._small) + len(self._main):
            raise IntegrityError("S3-FIFO small and main queues overlap")
        if residents != self._freq.keys() or residents & self._ghost.keys():
            raise IntegrityError("S3-FIFO frequencies or ghosts disagree with the queues")
        if any(not 0 <= f <= MAX_FREQ for f in self._freq.values()):
            raise IntegrityError("S3-FIFO frequency outside its 2-bit range")
        if len(self._ghost) > self._ghost_limit:
            raise IntegrityError(f"S3-FIFO keeps {len(self._ghost)} ghosts for {self._ghost_limit}")

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
