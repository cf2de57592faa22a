"""The store's books for one tier below the arena, and what serves it.

The tier object itself only stores bytes; this record owns what serves it (the I/O pool, the
circuit breaker, the read-speed estimate, the namespace of each chunk) and the tier's
placement books (:class:`~kvtier.store.placement.TierBooks`: which chunks it holds and their
sizes, the bytes in use and promised to writes in flight, the eviction policy, the admission
rules), which decide what the store does with it::

    used + reserved <= configured capacity         (checked by check_integrity)
    keys(sizes) == keys(policy)                    (every held chunk is evictable bookkeeping)
    capacity = min(configured, what the filesystem can still hold)

``capacity`` is learned: at start and every few seconds from the filesystem's free space,
and at once when a write fails with ENOSPC (for a backend that cannot report its free space,
until a cool-down passes). Writes then evict older chunks to make room, and
the change is logged once (not once per chunk).

The books change only through the methods here: a write is promised room
(:meth:`LowerTierState.make_room`), then either :meth:`stored` or :meth:`release`-d; an evicted
chunk is marked deleting until its delete ran (:meth:`mark_deleting`, :meth:`deleted`,
:meth:`clear_deleting`). Each change of what the tier holds (added, removed, deleted, used)
is announced to the listeners subscribed by the store (:meth:`subscribe`; the event log, and
a shared tier's journal), with its origin: this server's own (``HERE``), a peer's journal
record or a listing (:meth:`index`, :meth:`forget` say which), so the journal can leave out
what it must not echo (:mod:`kvtier.store.changes`).

A peer's record is a *booking* (:meth:`book`, :mod:`kvtier.store.bookings`): bounded per peer
and per tier, never making room by evicting a chunk this server wrote, read and verified
(:meth:`hit`) or found by a listing; room taken from it forgets it, never deletes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

from kvtier.codec import HEADER_SIZE, PAGE
from kvtier.config import TierConfig
from kvtier.errors import IntegrityError
from kvtier.keys import ChunkKey
from kvtier.policies import DEFAULT_PRIORITY, AdmissionPolicy, EvictionPolicy
from kvtier.shards import ShardedDict
from kvtier.store.bookings import Bookings, Limit
from kvtier.store.breaker import CircuitBreaker, OnChange
from kvtier.store.changes import Change, Origin, TierChange, TierListener
from kvtier.store.estimate import ReadEstimate
from kvtier.store.iopool import IOPool
from kvtier.store.placement import TierBooks
from kvtier.tiers import TIERS, LowerTier, Space
from kvtier.tiers.base import StoredChunk

log = logging.getLogger("kvtier.store")
FULL_COOL_DOWN_S = 5.0
"""How long a tier without ``space()`` stays held to what it has after a write refused as full
(the interval at which file tiers' free space is read)."""


class Room(NamedTuple):
    """What :meth:`LowerTierState.make_room` took: the victims to delete, and how many
    bookings it forgot (left on the tier)."""

    victims: list[tuple[ChunkKey, bytes]]
    forgotten: int


class LowerTierState:
    def __init__(self, config: TierConfig, chunk_bytes_hint: int, clock: Callable[[], float],
                 on_breaker_change: OnChange, tier: LowerTier | None = None) -> None:
        self.config = config
        self.name = config.name
        self.tier = tier or TIERS[config.type].from_config(config.name, config)
        self.clock = clock
        self.configured = config.capacity_bytes
        self.chunk_bytes_hint = chunk_bytes_hint
        self.smallest = self.tier.footprint(HEADER_SIZE + PAGE)
        self.implausible = 0
        """Chunks a listing found with a size no chunk here can have (left out)."""
        self.write_back = config.write_policy == "back"
        self.breaker = CircuitBreaker(config.breaker, clock, on_breaker_change)
        self.books = TierBooks(
            self.name, config.capacity_bytes, config.eviction,
            max(1, config.capacity_bytes // max(1, chunk_bytes_hint)), config.admission,
            write_back=self.write_back, fits_slot=self.tier.footprint(chunk_bytes_hint),
            available=self.breaker.allows, clock=clock)
        """Placement: what the tier holds, its eviction order and admission rules."""
        self.namespaces: ShardedDict[ChunkKey, bytes] = ShardedDict()
        """The namespace of each held chunk (shared tiers file chunks under it)."""
        self._interned: dict[bytes, bytes] = {}
        """One copy of each namespace this server wrote or listed (a peer's records may
        name any number of namespaces: theirs are interned only once a chunk is confirmed)."""
        self.pool = IOPool(self.name, config.io_threads, config.io_timeout_s, clock)
        self.reads = ReadEstimate()
        self.limited_by_filesystem = False
        self.full_until: float | None = None
        """Set while a tier without ``space()`` is held to what it has (see learn_space)."""
        self.rescan = False
        """The listing at start failed: list the tier once its breaker closes again."""
        self.listeners: list[TierListener] = []
        """Told each change of what the tier holds (:meth:`subscribe`)."""
        self._retained_here: dict[ChunkKey, tuple[int, float | None]] = {}
        """Peers' bookings retained here, not yet announced (a subset of the bookings):
        announced once a read or a listing confirms them."""

    def subscribe(self, listener: TierListener) -> None:
        """Tell ``listener`` every change of what the tier holds from now on."""
        self.listeners.append(listener)

    def _announce(self, change: Change, origin: Origin, key: ChunkKey, namespace: bytes,
                  size: int = 0, priority: int = DEFAULT_PRIORITY,
                  until: float | None = None) -> None:
        if self.listeners:
            told = TierChange(change, origin, self.name, key, namespace, size, priority, until)
            for listener in self.listeners:
                listener.tier_changed(told)

    def __contains__(self, key: object) -> bool:
        return key in self.books.sizes

    # The books, read-only here: they change through the methods below.
    @property
    def sizes(self) -> ShardedDict[ChunkKey, int]:
        return self.books.sizes  # type: ignore[return-value]

    @property
    def policy(self) -> EvictionPolicy[Hashable]:
        return self.books.policy

    @property
    def admission(self) -> list[AdmissionPolicy]:
        return self.books.admission

    @property
    def used(self) -> int:
        return self.books.used

    @property
    def reserved(self) -> int:
        return self.books.reserved

    @property
    def capacity(self) -> int:
        return self.books.capacity

    @property
    def stored_bytes(self) -> int:
        """The bytes of the books' chunks known to be on the tier: ``used`` less the
        bookings (which exist on a peer's word alone and are forgotten, not deleted, to make
        room)."""
        return self.books.used - self.books.bookings.bytes

    @property
    def bookings(self) -> Bookings:
        """The chunks held on a peer's word alone, by peer, and their bounds."""
        return self.books.bookings

    @property
    def deleting(self) -> set[ChunkKey]:
        """Keys whose delete is queued; not written again until it ran (the tier contract:
        never a write and a delete of one key at once)."""
        return self.books.deleting  # type: ignore[return-value]

    @property
    def fits_slot(self) -> int:
        """The largest size in the books of a chunk an arena slot (``chunk_bytes_hint``) can
        take; a larger one was written by a server with bigger slots."""
        assert self.books.fits_slot is not None
        return self.books.fits_slot

    def plausible(self, size: int) -> bool:
        """Whether a chunk of ``size`` bytes (a listing's size, a peer's journal record)
        can be one this server uses: a header and a page at least, at most what a slot here
        takes. Anything else stays out of the books: a larger chunk is a miss here anyway,
        and a forged size must not make this server evict everything to make room."""
        return self.smallest <= size <= self.fits_slot

    def plausible_only(self, chunks: Iterable[StoredChunk]
                       ) -> tuple[list[StoredChunk], list[StoredChunk]]:
        """The chunks of a listing that are ``plausible``, and the others (a pure function
        of the listing: it runs outside the lock; count the others with
        :meth:`count_implausible` under it)."""
        kept: list[StoredChunk] = []
        odd: list[StoredChunk] = []
        for chunk in chunks:
            (kept if self.plausible(chunk.size) else odd).append(chunk)
        return kept, odd

    def count_implausible(self, left: int) -> None:
        """Count ``left`` implausible chunks of a listing; the first time, say so (lock
        held)."""
        if left and not self.implausible:
            log.warning("tier %s: %d chunks listed with sizes no chunk here can have (not "
                        "%d to %d bytes) are left out of the books", self.name, left,
                        self.smallest, self.fits_slot)
        self.implausible += left

    @property
    def available(self) -> bool:
        """Reads and writes may go to the tier (its breaker is closed)."""
        return self.breaker.allows()

    # ------------------------------------------------------------------ admission, space

    def record_use(self, key: ChunkKey) -> None:
        self.books.record_use(key)

    def admits(self, key: ChunkKey, priority: int, prefix_tokens: int) -> bool:
        return self.books.admits(key, priority, prefix_tokens)

    def make_room(self, size: int, protected: Callable[[Hashable], bool]) -> Room | None:
        """Evict until ``size`` more bytes fit, and promise them to a write.

        Returns the evicted (key, namespace) pairs, already gone from the books (the caller
        deletes them), and how many peers' bookings were forgotten to make room (out of the
        books, left on the tier: :meth:`TierBooks.make_room`); or ``None`` if the chunk
        cannot fit even after evicting every unprotected chunk (nothing is evicted then).
        Walks the eviction order lazily: the cost is the victims, not the tier's size.
        """
        forgot: list[Hashable] = []
        chosen = self.books.make_room(size, protected, forgot)
        if chosen is None:
            return None
        victims: list[tuple[ChunkKey, bytes]] = []
        for raw in chosen:
            key = ChunkKey(raw)  # type: ignore[arg-type]
            namespace = self.namespaces.pop(key)
            self._retained_here.pop(key, None)
            victims.append((key, namespace))
            self._announce(Change.REMOVED, Origin.HERE, key, namespace)
        for raw in forgot:
            key = ChunkKey(raw)  # type: ignore[arg-type]
            self._retained_here.pop(key, None)
            self._announce(Change.REMOVED, Origin.HERE, key, self.namespaces.pop(key))
        return Room(victims, len(forgot))

    def touch(self, key: ChunkKey) -> None:
        """A use of a held chunk (a lease here, a peer's hit): later in the eviction order."""
        self.books.touch(key)

    def pinned(self, key: Hashable) -> bool:
        """Whether ``key`` is held here above the default priority now."""
        held = self.books.policy.retention(key)
        return held is not None and held[0] > DEFAULT_PRIORITY

    def set_priorities(self, keys: Sequence[ChunkKey], priority: int,
                       until: float | None = None) -> None:
        """Re-prioritise the held chunks of ``keys`` (a chain, head first); each is
        announced as retained here, tail first (a shared tier's peers keep it too). A peer's
        booking is retained here but announced only once a read or a listing confirms it:
        this server does not pass a peer's claim on under its own name."""
        self.books.set_priorities(keys, priority, until)
        if not self.listeners:
            return
        for key in reversed(keys):
            size = self.books.sizes.get(key)
            if size is None:
                continue
            if key in self.books.bookings:
                if priority > DEFAULT_PRIORITY:
                    self._retained_here[key] = (priority, until)
                else:
                    self._retained_here.pop(key, None)
                continue
            self._announce(Change.RETAINED, Origin.HERE, key, self.namespaces[key], size,
                           priority, until)

    def release(self, promised: int) -> None:
        """A write promised ``promised`` bytes by :meth:`make_room` stored nothing."""
        self.books.release(promised)

    def stored(self, key: ChunkKey, size: int, promised: int, priority: int,
               namespace: bytes, until: float | None = None) -> None:
        """This server's write of ``key`` finished: in the books (announced as added here),
        at ``priority`` until ``until`` (the arena copy's retention)."""
        self._add(key, size, promised, priority, namespace, Origin.HERE, until=until)

    def mark_deleting(self, key: ChunkKey) -> None:
        """A delete of ``key`` (already out of the books) is queued: no write until it ran."""
        self.books.mark_deleting(key)

    def clear_deleting(self, key: ChunkKey) -> None:
        """The queued delete of ``key`` failed or was given up (it may be queued again)."""
        self.books.clear_deleting(key)

    def deleted(self, key: ChunkKey, namespace: bytes) -> None:
        """The queued delete of ``key`` ran (announced as deleted here)."""
        self.books.clear_deleting(key)
        self._announce(Change.DELETED, Origin.HERE, key, namespace)

    def lost(self, key: ChunkKey) -> None:
        """A read found ``key`` missing or corrupt (quarantined): out of the books, and, if
        it was held, announced as deleted here."""
        namespace = self.forget(key, origin=Origin.HERE)
        if namespace is not None:
            self._announce(Change.DELETED, Origin.HERE, key, namespace)

    def swept(self, key: ChunkKey, namespace: bytes) -> None:
        """This server's sweeper deleted ``key`` from the tier: out of the books (if held)
        and announced as deleted here."""
        self.forget(key, origin=Origin.HERE)
        self._announce(Change.DELETED, Origin.HERE, key, namespace)

    def hit(self, key: ChunkKey, namespace: bytes, nbytes: int) -> None:
        """A chunk of ``nbytes`` read from the tier and verified: confirmed if it was a
        peer's booking (announced as used here: the others' recency)."""
        self._confirm(key, self.tier.footprint(nbytes))
        self._announce(Change.USED, Origin.HERE, key, namespace)

    def _confirm(self, key: ChunkKey, size: int) -> None:
        if key in self.books.bookings:
            self.books.confirm(key, size)
            namespace = self.namespaces[key]
            self.namespaces[key] = self._interned.setdefault(namespace, namespace)
            retained = self._retained_here.pop(key, None)
            if retained is not None and (retained[1] is None or retained[1] > self.clock()):
                self._announce(Change.RETAINED, Origin.HERE, key, namespace, size, *retained)

    def unlisted(self, reason: str) -> None:
        """The listing at start failed: bypass the tier until a probe passes, then list it
        again (a node-local tier by a rescan; a shared one relists on its own once it
        falls behind its journal)."""
        self.breaker.trip(reason)
        self.rescan = not self.tier.shared

    def start_rescan(self) -> None:
        self.rescan = False

    def rescan_later(self) -> None:
        """The rescan failed or was given up: try again once the tier is available."""
        self.rescan = True

    def _add(self, key: ChunkKey, size: int, promised: int, priority: int,
             namespace: bytes, origin: Origin, *, peer: str | None = None,
             until: float | None = None) -> None:
        """Account ``key`` and make it evictable (one held already, e.g. found by a listing
        meanwhile, is removed first and added again as new)."""
        if key in self.books:
            self.forget(key, origin=origin)
        self.books.add(key, size, promised, priority, peer=peer, until=until)
        self.namespaces[key] = (self._interned.get(namespace, namespace) if peer is not None
                                else self._interned.setdefault(namespace, namespace))
        self._announce(Change.ADDED, origin, key, namespace, size, priority, until)

    def index(self, key: ChunkKey, size: int, priority: int, namespace: bytes) -> None:
        """A chunk a listing found in the tier: account it, oldest first (one held as a
        peer's booking is confirmed)."""
        if key in self.books.bookings:
            self._confirm(key, size)
            return
        self._add(key, size, 0, priority, namespace, Origin.LISTING)

    def book(self, key: ChunkKey, size: int, namespace: bytes, peer: str,
             retention: tuple[int, float | None] = (DEFAULT_PRIORITY, None)) -> Limit | None:
        """Another server's journal record says ``peer`` wrote ``key`` (not held here):
        account it as that peer's booking, newest first, at ``retention`` (priority, until:
        already capped, :mod:`kvtier.store.peer_retention`); or, past a bound, refuse it
        (returns which bound)."""
        refused = self.books.bookings.refusal(peer, size)
        if refused is None:
            priority, until = retention
            self._add(key, size, 0, priority, namespace, Origin.PEER, peer=peer, until=until)
        return refused

    def retain(self, key: ChunkKey, priority: int, until: float) -> None:
        """A peer retained ``key`` (held here) at ``priority`` until ``until`` (capped
        already): kept so where that lasts longer than what it has (a stronger retention
        it has stays)."""
        held = self.policy.retention(key)
        if held is None:
            return
        mine = (held[0], float("inf") if held[1] is None else held[1])
        if (priority, until) > mine:
            self.books.set_priorities([key], priority, until)

    def forget(self, key: ChunkKey, *, origin: Origin) -> bytes | None:
        """Drop ``key`` from the books (deleted, corrupt, missing; ``origin``: who says so);
        returns its namespace, ``None`` if it was not held."""
        if not self.books.forget(key):
            return None
        self._retained_here.pop(key, None)
        namespace = self.namespaces.pop(key)
        self._announce(Change.REMOVED, origin, key, namespace)
        return namespace

    def learn_space(self, space: Space | None, full: bool = False) -> None:
        """Never promise more than the filesystem can hold (``full``: a write just failed
        with ENOSPC, so it holds no more than what we have now).

        A tier that cannot say how much room it has (``space()`` is ``None``: Redis at
        ``maxmemory``) is held to what it has only for ``FULL_COOL_DOWN_S``; then its
        configured capacity is back (:meth:`cool_down`), so one refusal is not forever.
        """
        if space is None and not full:
            return
        if space is None:
            self._full_backend()
            return
        stored = self.stored_bytes
        limit = self.configured
        keep = self.config.keep_free_bytes
        if keep is None:
            keep = max(self.chunk_bytes_hint, space.total // 100)
        limit = min(limit, stored + max(0, space.free - keep))
        if full:
            limit = min(limit, stored)
        limited = limit < self.configured
        if limited and not self.limited_by_filesystem:
            log.warning("tier %s: the filesystem holds only %d more bytes; capacity lowered "
                        "from %d to %d bytes (older chunks are evicted to make room)",
                        self.name, max(0, limit - stored), self.configured, limit)
        elif self.limited_by_filesystem and not limited:
            log.info("tier %s: the filesystem has room again; capacity back to %d bytes",
                     self.name, self.configured)
        self.limited_by_filesystem = limited
        self.books.set_capacity(limit)

    def _full_backend(self) -> None:
        if self.full_until is None:
            log.warning("tier %s: the backend refused a write as full; capacity lowered from "
                        "%d to %d bytes for %g s (older chunks are evicted to make room)",
                        self.name, self.capacity, self.stored_bytes, FULL_COOL_DOWN_S)
        self.full_until = self.clock() + FULL_COOL_DOWN_S
        self.books.set_capacity(min(self.capacity, self.stored_bytes))

    def cool_down(self) -> None:
        """Give a tier that refused a write as full (no ``space()``) its capacity back once
        ``FULL_COOL_DOWN_S`` passed without another refusal."""
        if self.full_until is not None and self.clock() >= self.full_until:
            self.full_until = None
            self.books.set_capacity(self.configured)
            log.info("tier %s: capacity back to %d bytes (no write refused as full for %g s)",
                     self.name, self.configured, FULL_COOL_DOWN_S)

    def largest_table(self) -> int:
        """Keys in the largest hash table of this tier's books: what one change may rehash
        at once (the interpreter does nothing else meanwhile: no lookup runs)."""
        return max(self.books.largest_table(), self.namespaces.largest_shard())

    def check_integrity(self) -> None:
        self.books.check_integrity()
        if self.sizes.keys() != self.namespaces.keys():
            raise IntegrityError(f"tier {self.name}: index and namespaces disagree")
        if any(key not in self.books.bookings for key in self._retained_here):
            raise IntegrityError(f"tier {self.name}: a retention kept for a booking that is "
                                 "no longer one")
        over = self.used + self.reserved > self.configured and not self.tier.shared
        if over or self.reserved < 0:  # a shared tier's books also hold others' writes
            raise IntegrityError(
                f"tier {self.name}: used {self.used} + reserved {self.reserved} exceeds "
                f"capacity {self.configured}"
            )

    def close(self, wait_s: float = 10.0) -> None:
        self.pool.close(wait_s)
        self.tier.close()
