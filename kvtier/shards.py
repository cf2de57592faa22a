"""Maps that never stall the interpreter to grow: many small dicts instead of one big one.

A Python dict grows by rehashing every entry into a table twice the size, in one C call that
holds the interpreter lock (GIL) throughout: at a million entries that is tens of
milliseconds in which no other thread of the process runs, a lookup included, whatever lock
it waits on. The books of a shared tier grow with every record a peer's journal note brings,
so a peer flooding the journal would make each such growth a pause of every lookup.

:class:`ShardedDict` spreads its keys over ``SHARDS`` small dicts by a window of bits of
``hash(key)``; each shard grows on its own, so one insert rehashes at most one shard (about
``len / SHARDS`` entries). :class:`EpochOrder` (an LRU's order) keeps keys in dicts of at
most ``EPOCH`` keys::

    ShardedDict                   a mapping           shard = (hash(key) >> shift) & MASK
      shards[0] … shards[63]      plain dicts         each grows alone
    EpochOrder                    keys, oldest first  epochs of <= EPOCH keys, in turn;
                                                      each key's epoch in a ShardedDict

Plain dicts of plain keys and values (bytes, ints, str, None) are not tracked by the garbage
collector, so these cost a full collection nothing however many keys they hold.

The window (``shift``) is high in the hash (bits 40-63), so the bits a shard's own table
indexes by are not the bits that chose the shard; each new instance takes the next of four
windows, so maps holding the same keys (a tier's sizes and namespaces) grow at different
inserts. Keys of a peer's notes are 32-byte hashes a peer picks freely, but ``hash`` of bytes
is keyed per process (SipHash, random seed): a peer cannot pick keys that land in one shard.
Small integer keys land in shard 0: correct, just not spread.

A single-threaded replay (the trace simulator) has no lookup to stall and pays for the
sharding on every access: it takes :class:`Table` (:func:`table`), one plain dict, and its LRU
one OrderedDict (:class:`~kvtier.policies.lru.PlainLRU`).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Iterator, MutableMapping
from typing import TypeVar, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")
SHARDS = 64
MASK = SHARDS - 1
EPOCH = 4096
"""Keys an :class:`EpochOrder`'s epoch takes before the next begins."""
_WINDOWS = itertools.cycle((40, 46, 52, 58))
_MISSING = object()


class ShardedDict(MutableMapping[K, V]):
    """A dict's interface over ``SHARDS`` dicts (iteration: shard by shard, each in
    insertion order)."""

    __slots__ = ("_len", "_shards", "_shift")

    def __init__(self, items: Iterable[tuple[K, V]] = ()) -> None:
        self._shards: list[dict[K, V]] = [{} for _ in range(SHARDS)]
        self._shift = next(_WINDOWS)
        self._len = 0
        for key, value in items:
            self[key] = value

    def _shard(self, key: object) -> dict[K, V]:
        return self._shards[(hash(key) >> self._shift) & MASK]

    def __getitem__(self, key: K) -> V:
        return self._shards[(hash(key) >> self._shift) & MASK][key]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | T, /) -> V | T: ...

    def get(self, key: K, default: object = None, /) -> object:
        return self._shards[(hash(key) >> self._shift) & MASK].get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._shards[(hash(key) >> self._shift) & MASK]

    def __setitem__(self, key: K, value: V) -> None:
        shard = self._shards[(hash(key) >> self._shift) & MASK]
        size = len(shard)
        shard[key] = value
        self._len += len(shard) - size

    def __delitem__(self, key: K) -> None:
        del self._shard(key)[key]
        self._len -= 1

    @overload
    def pop(self, key: K, /) -> V: ...
    @overload
    def pop(self, key: K, default: V | T, /) -> V | T: ...

    def pop(self, key: K, default: object = _MISSING, /) -> object:
        shard = self._shard(key)
        if key in shard:
            self._len -= 1
            return shard.pop(key)
        if default is _MISSING:
            raise KeyError(key)
        return default

    def __iter__(self) -> Iterator[K]:
        return itertools.chain.from_iterable(self._shards)

    def __len__(self) -> int:
        return self._len

    def clear(self) -> None:
        for shard in self._shards:
            shard.clear()
        self._len = 0

    def largest_shard(self) -> int:
        """Entries in the fullest shard: what one insert may rehash at most."""
        return max(map(len, self._shards))

    def __repr__(self) -> str:
        return f"ShardedDict({len(self)} entries)"


class EpochOrder(Iterable[K]):
    """Keys in the order they were added or last moved to the end (oldest first), like an
    OrderedDict's keys, but in *epochs*: plain dicts of at most ``EPOCH`` keys each, added in
    turn, and a :class:`ShardedDict` naming each key's epoch::

        epochs  {0: {k1, k4}, 3: {k9}, 7: {k12, k13, k2}}   oldest epoch first, each in
                                                            insertion order
        where   {k1: 0, k4: 0, k9: 3, k12: 7, ...}           (sharded)

    Moving a key to the end takes it out of its epoch and adds it to the newest. No dict
    here ever holds more than ``EPOCH`` keys or a shard's share, so no change rehashes many
    keys; and dicts of plain keys and values are not tracked by the garbage collector (an
    OrderedDict is, and a full collection visits every key it holds). An epoch that lost
    most of its keys is copied to a compact dict (at most ``EPOCH / 8`` keys), so the keys
    skipped while iterating and the memory of the leftovers stay bounded."""

    __slots__ = ("_added", "_epochs", "_newest", "_where")

    def __init__(self) -> None:
        self._epochs: dict[int, dict[K, None]] = {0: {}}
        self._newest = 0
        self._added = 0
        """Keys added to the newest epoch (deleted ones included)."""
        self._where: ShardedDict[K, int] = ShardedDict()

    def add(self, key: K) -> None:
        """Append ``key`` (absent) as the newest."""
        if key in self._where:
            raise KeyError(f"key already in the order: {key!r}")
        self._append(key)

    def _append(self, key: K) -> None:
        if self._added >= EPOCH:
            self._settle(self._newest)
            self._newest += 1
            self._epochs[self._newest] = {}
            self._added = 0
        self._epochs[self._newest][key] = None
        self._added += 1
        self._where[key] = self._newest

    def move_to_end(self, key: K) -> None:
        """Make the present ``key`` the newest (KeyError if absent)."""
        self._take(key)
        self._append(key)

    def remove(self, key: K) -> None:
        """Drop the present ``key`` (KeyError if absent)."""
        self._take(key)

    def _take(self, key: K) -> None:
        epoch = self._where.pop(key)
        keys = self._epochs[epoch]
        del keys[key]
        if epoch != self._newest and len(keys) == EPOCH // 8 - 1:
            self._settle(epoch)
        elif not keys and epoch != self._newest:
            del self._epochs[epoch]

    def _settle(self, epoch: int) -> None:
        """An old epoch with fewer than ``EPOCH / 8`` keys left: a compact copy of it (its
        order kept), or none if it is empty."""
        keys = self._epochs[epoch]
        if not keys:
            del self._epochs[epoch]
        elif len(keys) < EPOCH // 8:
            self._epochs[epoch] = dict(keys)

    def __iter__(self) -> Iterator[K]:
        """Oldest first; the order must not change while this is iterated."""
        return itertools.chain.from_iterable(self._epochs.values())

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def largest_shard(self) -> int:
        """Keys in the largest dict here: what one insert may rehash at most."""
        return max(self._where.largest_shard(), max(map(len, self._epochs.values())))


class Table(dict[K, V]):
    """A plain dict with :class:`ShardedDict`'s extra method (one table: it rehashes whole)."""

    __slots__ = ()

    def largest_shard(self) -> int:
        return len(self)


def table(sharded: bool) -> ShardedDict[K, V] | Table[K, V]:
    """A new map: sharded for a server's books, plain for a single-threaded replay."""
    return ShardedDict() if sharded else Table()
