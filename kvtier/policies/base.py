"""Policy contracts. Policies decide; tiers and the store do the bookkeeping.

An eviction *algorithm* (LRU, ARC, S3-FIFO: one small file each) only orders the keys of one
tier and names victims. :class:`EvictionPolicy` wraps one algorithm instance per retention
priority (0-100, TensorRT-LLM's scale, default 35) and always takes victims from the lowest
priority present first, so a chunk at priority 80 outlives any number of chunks at 35::

    EvictionPolicy
      buckets[0]  -> Algorithm   (evicted first)
      buckets[35] -> Algorithm
      buckets[80] -> Algorithm   (evicted last)

A priority may come with a deadline (``until``, on the policy's ``clock``): past it, the key
falls back to the default priority, entering that bucket as if stored then. Expiry is lazy:
deadlines wait in a heap, and the ones due are applied where a victim is chosen or a priority
read, so its cost is O(log n) per deadline set, never a scan of the keys. So a guess (the
next use comes within D seconds) is a soft, expiring bonus when it is a short retention: under
LRU a key retained above the default for D seconds at time t leaves, among the keys at the
default, where one last used at t + D would; a long one over-protects.

``evict(n, protected)`` is all-or-nothing: it returns exactly ``n`` victims, or ``None`` and
changes nothing. Keys for which ``protected(key)`` is true (leased, being written or read)
are never returned.

Chunks form prefix chains: a chunk is servable only while every chunk before it is. A caller
that knows the chunk before a key passes it as ``insert(key, parent=...)``; algorithms that
order by chain (``prefix``) use it, the others ignore it. :meth:`EvictionPolicy.unreachable`
counts tracked keys whose parent is not tracked: data a lookup of this tier alone cannot reach.

An :class:`AdmissionPolicy` says whether a chunk may be written to a lower tier at all; it
sees every use of a key through :meth:`AdmissionPolicy.record`.
"""

from __future__ import annotations

import heapq
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.policies.retention import (
    DEFAULT_PRIORITY,
    check_priority,
)
from kvtier.shards import ShardedDict, Table, table

K = TypeVar("K", bound=Hashable)


class Algorithm(ABC, Generic[K]):
    """One eviction algorithm over the keys of one priority bucket.

    ``capacity`` is the tier's size in entries; algorithms with ghost lists or adaptive
    targets (ARC, S3-FIFO) size them from it. The wrapper guarantees that ``insert`` is only
    called for absent keys and ``touch``/``remove``/``evicted`` only for present ones.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)

    @abstractmethod
    def insert(self, key: K) -> None:
        """Add a key that was just stored (it may be in a ghost list)."""

    @abstractmethod
    def touch(self, key: K) -> None:
        """Record a hit on a present key."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget a present key that left for another reason (deleted, corrupt, moved)."""

    def insert_after(self, key: K, parent: K) -> None:
        """Add ``key`` whose chain parent is ``parent`` (which may be absent from this
        bucket). Default: the hint is ignored."""
        self.insert(key)

    @abstractmethod
    def victims(self) -> Iterator[K]:
        """Present keys in the order this algorithm would evict them. Must not mutate."""

    def victims_for(self, protected: Callable[[K], bool]) -> Iterator[K]:
        """The unprotected keys of :meth:`victims`, in order; each is evicted if the caller
        reaches the next one. Algorithms whose order depends on which keys leave (a parent
        follows its last child) override it. Must not mutate."""
        return (key for key in self.victims() if not protected(key))

    @abstractmethod
    def evicted(self, key: K) -> None:
        """A key returned by ``victims`` was chosen; drop it (ghost lists may keep its name)."""

    def largest_table(self) -> int:
        """Keys in the largest hash table this algorithm holds: what one insert may rehash
        at once. Default: all of them in one."""
        return len(self)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


class EvictionPolicy(Generic[K]):
    """Priority buckets of one algorithm; see the module docstring."""

    def __init__(self, make: Callable[[int], Algorithm[K]], capacity: int,
                 clock: Callable[[], float] = time.monotonic, *, sharded: bool = True) -> None:
        """``sharded``: tables that never rehash many keys at once (a server's, whose lookups
        must not stall); False for a single-threaded replay, which they only slow down."""
        # an algorithm may name a plain twin for replays (LRU: PlainLRU)
        self._make = make if sharded else getattr(make, "plain", make)
        self.capacity = capacity
        self.clock = clock
        """What deadlines (``until``) are read against."""
        self._buckets: dict[int, Algorithm[K]] = {}
        self._ranked: list[int] = []
        """The priorities of ``_buckets``, lowest first (buckets are never dropped)."""
        self._priority: ShardedDict[K, int] | Table[K, int] = table(sharded)
        """Each tracked key's priority (sharded: growing never rehashes every key at once)."""
        self._parent: ShardedDict[K, K] | Table[K, K] = table(sharded)
        """The chain parent of each tracked key inserted with one."""
        self._until: ShardedDict[K, tuple[float, int]] | Table[K, tuple[float, int]] = \
            table(sharded)
        """Each key whose priority falls back: its deadline and the heap entry's number (the
        entry's own ``mark`` object; sharded like ``_priority``)."""
        self._due: list[tuple[float, int, tuple[float, int], list[K]]] = []
        """Deadlines, soonest first: (deadline, number, mark, the keys set to it together,
        tail first); a key whose ``_until`` is no longer the entry's mark is skipped lazily
        (numbers are unique, so heap order never compares marks or keys)."""
        self._due_keys = 0
        """Keys listed in ``_due``, stale ones included (compacted when they dominate)."""
        self._seq = 0
        self.expired = 0
        """Keys that fell back to the default priority at their deadline, so far."""

    def insert(self, key: K, priority: int = DEFAULT_PRIORITY, parent: K | None = None,
               until: float | None = None) -> None:
        """Track a newly stored key, after ``parent`` in its prefix chain if given, at
        ``priority`` until ``until`` (then the default). Raises KeyError if it is already
        tracked."""
        if key in self._priority:
            raise KeyError(f"key already tracked by the eviction policy: {key!r}")
        priority = check_priority(priority)
        until = self._check_until(until)
        if until is not None and until <= self.clock():
            priority, until = DEFAULT_PRIORITY, None
        bucket = self._bucket(priority)
        if parent is None or parent == key:  # a chunk cannot follow itself: no hint
            bucket.insert(key)
        else:
            bucket.insert_after(key, parent)
            self._parent[key] = parent
        self._priority[key] = priority
        if until is not None:  # a new key has no deadline to clear
            self._set_until([key], priority, until)

    def touch(self, key: K) -> None:
        """Record a hit; unknown keys are ignored (a hit may race an eviction)."""
        priority = self._priority.get(key)
        if priority is not None:
            self._buckets[priority].touch(key)

    def remove(self, key: K) -> None:
        """Forget a key; unknown keys are ignored."""
        priority = self._priority.pop(key, None)
        if priority is not None:
            self._buckets[priority].remove(key)
            self._parent.pop(key, None)
            self._until.pop(key, None)

    def set_priority(self, key: K, priority: int, until: float | None = None) -> None:
        """Move a tracked key to ``priority`` until ``until`` (then the default; ``None``:
        until changed). Moved, it counts as stored anew there; at its own priority only
        its deadline changes."""
        self.set_priorities((key,), priority, until)

    def set_priorities(self, keys: Sequence[K], priority: int,
                       until: float | None = None) -> None:
        """Move the tracked ``keys`` of one prefix chain (head first, as a request lists
        them) to ``priority``, tail first: the head is moved last, so it is the most recent
        in its new bucket and the chain still leaves tail first (a head that left first
        would make the rest of its chain unreachable). Their deadlines, set in the same
        order, make them fall back tail first too."""
        priority = check_priority(priority)
        until = self._check_until(until)
        if until is not None and until <= self.clock():
            priority, until = DEFAULT_PRIORITY, None
        tracked = self._priority
        moved = [key for key in reversed(keys) if key in tracked]
        for key in moved:
            if tracked[key] != priority:  # at its priority already: only the deadline moves
                self._move(key, priority)
        self._set_until(moved, priority, until)

    def priority(self, key: K) -> int | None:
        """The key's priority now (past its deadline: the default); ``None`` if untracked."""
        self.expire()
        return self._priority.get(key)

    def peek_priority(self, key: K) -> int:
        """The key's priority as last applied (a deadline passed but not yet applied still
        counts), the default if untracked. Changes nothing, so another thread may call it
        without the owner's lock (a single dict read): what a sweep orders by."""
        priority = self._priority.get(key)
        return DEFAULT_PRIORITY if priority is None else priority

    def retention(self, key: K) -> tuple[int, float | None] | None:
        """The key's priority now and its deadline (``None``: none); ``None`` if untracked."""
        self.expire()
        priority = self._priority.get(key)
        if priority is None:
            return None
        until = self._until.get(key)
        return priority, None if until is None else until[0]

    @property
    def retained(self) -> int:
        """Keys whose priority falls back at a deadline."""
        return len(self._until)

    def expire(self, limit: int | None = None) -> int:
        """Move every key past its deadline to the default priority, soonest deadline
        first (a chain set together falls back tail first); returns how many. O(1) when
        none is due. With ``limit``, stops once that many keys were looked at (a chain set
        together is finished): :attr:`has_due` says whether more are due."""
        due = self._due
        if not due or due[0][0] > self.clock():
            return 0
        now, moved, seen = self.clock(), 0, 0
        while due and due[0][0] <= now and (limit is None or seen < limit):
            _until, _seq, mark, keys = heapq.heappop(due)
            seen += len(keys)
            self._due_keys -= len(keys)
            for key in keys:
                if self._until.get(key) is mark:  # else changed or gone since
                    del self._until[key]
                    self._move(key, DEFAULT_PRIORITY)
                    moved += 1
        self.expired += moved
        return moved

    @property
    def has_due(self) -> bool:
        """Whether a deadline has passed that :meth:`expire` has not applied yet."""
        return bool(self._due) and self._due[0][0] <= self.clock()

    def count_by_priority(self) -> dict[int, int]:
        """Tracked keys per priority, as of the last deadline applied (read-only: safe for
        gauges read beside the owner's lock); O(priorities used)."""
        return {p: len(bucket) for p, bucket in list(self._buckets.items()) if len(bucket)}

    def _move(self, key: K, priority: int) -> None:
        old = self._priority[key]
        if old == priority:
            return
        self._buckets[old].remove(key)
        parent = self._parent.get(key)
        if parent is None:
            self._bucket(priority).insert(key)
        else:
            self._bucket(priority).insert_after(key, parent)
        self._priority[key] = priority

    def _set_until(self, keys: list[K], priority: int, until: float | None) -> None:
        """Give ``keys`` (in the order they are to fall back) one deadline, or none."""
        if until is None or priority == DEFAULT_PRIORITY:
            if self._until:
                for key in keys:
                    self._until.pop(key, None)
            return
        if not keys:
            return
        self._seq += 1
        mark = (until, self._seq)
        self._until.update(dict.fromkeys(keys, mark))
        heapq.heappush(self._due, (until, self._seq, mark, keys))
        self._due_keys += len(keys)
        if self._due_keys > 2 * len(self._until) + 64:  # stale entries: compact, amortized
            self._compact()

    def _compact(self) -> None:
        live = self._until
        due = [(u, n, mark, kept) for u, n, mark, keys in self._due
               if (kept := [k for k in keys if live.get(k) is mark])]
        heapq.heapify(due)
        self._due = due
        self._due_keys = sum(len(keys) for _, _, _, keys in due)

    @staticmethod
    def _check_until(until: float | None) -> float | None:
        if until is None:
            return None
        if isinstance(until, bool) or not isinstance(until, (int, float)) or not math.isfinite(
                until):
            raise ValueError(f"until must be a finite time or None, got {until!r}")
        return float(until)

    def evict(self, n: int, protected: Callable[[K], bool] = lambda _: False) -> list[K] | None:
        """Choose ``n`` unprotected victims, lowest priority first, and forget them.

        Returns the victims in eviction order, or ``None`` (and changes nothing) when fewer
        than ``n`` unprotected keys exist.
        """
        if n <= 0:
            return []
        if self._due:
            self.expire()
        if n == 1:  # the common case, without the general walk
            for priority in self._ranked:
                bucket = self._buckets[priority]
                if len(bucket):
                    for key in bucket.victims_for(protected):
                        return self._forget([(priority, key)])
            return None
        chosen: list[tuple[int, K]] = []
        for priority in self._ranked:
            for key in self._buckets[priority].victims_for(protected):
                chosen.append((priority, key))
                if len(chosen) == n:
                    break
            if len(chosen) == n:
                break
        if len(chosen) < n:
            return None
        return self._forget(chosen)

    def evict_bytes(self, need: int, size_of: Callable[[K], int],
                    protected: Callable[[K], bool] = lambda _: False) -> list[K] | None:
        """Unprotected victims whose sizes add up to at least ``need``, lowest priority
        first, forgotten; or ``None`` (and nothing changes) when all of them are too few.

        Walks the eviction order lazily, so the cost is the victims, not the tier's size.
        """
        if self._due:
            self.expire()
        chosen: list[tuple[int, K]] = []
        freed = 0
        for priority in self._ranked:
            for key in self._buckets[priority].victims_for(protected):
                if freed >= need:
                    break
                chosen.append((priority, key))
                freed += size_of(key)
            if freed >= need:
                break
        if freed < need:
            return None
        return self._forget(chosen)

    def _forget(self, chosen: list[tuple[int, K]]) -> list[K]:
        for priority, key in chosen:
            self._buckets[priority].evicted(key)
            del self._priority[key]
            self._parent.pop(key, None)
            self._until.pop(key, None)
        return [key for _, key in chosen]

    def unreachable(self, held_elsewhere: Callable[[K], bool] | None = None) -> int:
        """Tracked keys that no lookup can reach: a chain parent (as hinted), or one of its
        ancestors, is neither tracked here nor held elsewhere (``held_elsewhere``: where
        else a lookup finds chunks, e.g. other tiers). The space holes waste. O(n)."""
        reachable: dict[K, bool] = {}
        for key in self._priority:
            path: dict[K, None] = {}  # ordered, and a set for the loop check
            k: K | None = key
            while k is not None and k not in reachable:
                if k not in self._priority:  # the chain leaves this tier here
                    reachable[k] = held_elsewhere is not None and held_elsewhere(k)
                    break
                if k in path:  # hints in a loop are no chain (algorithms refuse it too)
                    reachable[k] = True
                    break
                path[k] = None
                k = self._parent.get(k)
            ok = True if k is None else reachable[k]
            for step in path:
                reachable[step] = ok
        return sum(1 for key in self._priority if not reachable[key])

    def order(self) -> list[K]:
        """Every tracked key in eviction order (for tests and admin views)."""
        self.expire()
        return [k for p in sorted(self._buckets) for k in self._buckets[p].victims()]

    def largest_table(self) -> int:
        """Keys in the largest hash table of this policy (its algorithms' included): what
        one insert may rehash at once."""
        return max([self._priority.largest_shard(), self._parent.largest_shard(),
                    self._until.largest_shard(),
                    *(bucket.largest_table() for bucket in self._buckets.values())])

    def __len__(self) -> int:
        return len(self._priority)

    def __contains__(self, key: object) -> bool:
        return key in self._priority

    def _bucket(self, priority: int) -> Algorithm[K]:
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = self._make(self.capacity)
            self._ranked = sorted(self._buckets)
        return bucket


@dataclass(frozen=True)
class AdmissionContext:
    """What an admission rule may look at when a chunk is offered to a lower tier."""

    key: bytes
    priority: int
    prefix_tokens: int
    """Tokens of the whole prefix this chunk completes (chunk index + 1) * chunk tokens."""


class AdmissionPolicy(ABC):
    """Decides whether a chunk may be written to one lower tier."""

    def __init__(self, param: int) -> None:
        self.param = param

    def record(self, key: bytes) -> None:  # noqa: B027 - an optional hook, empty on purpose
        """A use of ``key`` (stored or hit in the tier above). Default: not needed."""

    @abstractmethod
    def admit(self, ctx: AdmissionContext) -> bool:
        """True to write the chunk to the tier; never raises for a well-formed context."""
