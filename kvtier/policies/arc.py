"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), as an eviction order."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvtier.errors import IntegrityError
from kvtier.policies.base import Algorithm, K


class ARC(Algorithm[K]):
    """ARC balances recency against frequency and learns the balance from its mistakes.

    Four lists, each oldest first::

        B1 (ghosts) | T1 (seen once)  ||  T2 (seen twice or more) | B2 (ghosts)

    A new key enters T1; a hit moves a key to the newest end of T2, so a long scan of one-time
    keys only churns T1. An evicted key leaves its name in the ghost list beside its list (T1
    -> B1, T2 -> B2). Re-inserting a name from B1 means T1 was too small: the target size ``p``
    of T1 grows (by ``max(1, |B2|/|B1|)``); a name from B2 shrinks it. Either way the key goes
    to T2. Victims come from T1 while ``|T1| > p`` (or T2 is empty), otherwise from T2. Ghosts
    are names only, kept to ``|T1| + |B1| <= capacity`` and ``|B1| + |B2| <= capacity``.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[K, None] = OrderedDict()
        self._t2: OrderedDict[K, None] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._p = 0.0

    @property
    def target(self) -> float:
        """The adaptive target size of T1 (``p``), between 0 and ``capacity``."""
        return self._p

    @property
    def ghost_count(self) -> int:
        """Names remembered in B1 and B2; never more than ``capacity``."""
        return len(self._b1) + len(self._b2)

    def insert(self, key: K) -> None:
        if key in self._b1:
            self._p = min(float(self.capacity), self._p + max(1.0, len(self._b2) / len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(1.0, len(self._b1) / len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
            self._trim_ghosts()

    def touch(self, key: K) -> None:
        self._t1.pop(key, None)
        self._t2[key] = None
        self._t2.move_to_end(key)

    def remove(self, key: K) -> None:
        # Not an eviction: the key left for another reason, so no ghost is kept.
        if key in self._t1:
            del self._t1[key]
        else:
            del self._t2[key]

    def victims(self) -> Iterator[K]:
        # Replays ARC's REPLACE step with p fixed: counts stand in for the shrinking lists.
        t1, t2 = iter(self._t1), iter(self._t2)
        n1, n2 = len(self._t1), len(self._t2)
        while n1 or n2:
            if n1 and (n1 > self._p or not n2):
                n1 -= 1
                yield next(t1)
            else:
                n2 -= 1
                yield next(t2)

    def evicted(self, key: K) -> None:
        if key in self._t1:
            del self._t1[key]
            self._b1[key] = None
        else:
            del self._t2[key]
            self._b2[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > self.capacity:
            (self._b2 or self._b1).popitem(last=False)

    def check_integrity(self) -> None:
        """Raise IntegrityError if the lists overlap or the ghosts or target are out of bounds."""
        lists = (self._t1, self._t2, self._b1, self._b2)
        if sum(map(len, lists)) != len(set().union(*lists)):
            raise IntegrityError("ARC lists overlap")
        if self.ghost_count > self.capacity:
            raise IntegrityError(f"ARC keeps {self.ghost_count} ghosts for {self.capacity}")
        if not 0.0 <= self._p <= self.capacity:
            raise IntegrityError(f"ARC target {self._p} outside [0, {self.capacity}]")

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
