"""Where chunks go: the store's placement decisions, pure and synchronous.

Plain values in, decisions out: no slots, no I/O, no threads, no lock. The store
(:class:`~kvtier.store.core.TieredStore`) wraps these with arena slots, I/O pools and its lock;
``kvtier trace simulate`` (:mod:`kvtier.trace.simulate`) drives them directly, so the two
cannot drift apart::

    servable      servable_tiers(keys, servable)    the prefix rule: the first miss ends it
                  servable_prefix(keys, servable)   the same, each tier with its key (a lease)
                  lower_source(tiers, key)          the first available lower tier holding a
                                                    chunk at a size an arena slot takes
    admission     TierBooks.record_use, refusal     a use of a key; why a copy is refused
    write-through write_targets(tiers, key, ...)    the tiers a copy goes to (through, or
                                                    back when the arena evicts it)
    victims       TierBooks.make_room               a lower tier's victims, all or nothing
                  make_slot                         the arena's: one victim per slot; a victim
                                                    written back first frees no slot now
                  free_target, free_ahead           write-back ahead of need

One :class:`TierBooks` per lower tier holds what these decide with: the eviction order, the
admission rules, the size of each chunk held, the bytes used and promised to copies under way,
the capacity, the keys whose delete is queued, and the chunks booked on a peer's word alone
(:mod:`kvtier.store.bookings`), which never cost a confirmed chunk its place::

    used == sum(sizes)     keys(sizes) == keys(policy)     used + reserved <= capacity
    bookings ⊆ sizes       room is taken from bookings first (forgotten, not deleted)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Literal, Protocol, TypeVar

from kvtier.errors import IntegrityError
from kvtier.policies import (
    DEFAULT_PRIORITY,
    AdmissionContext,
    AdmissionPolicy,
    EvictionPolicy,
    admits,
    make_admission,
    make_eviction,
)
from kvtier.shards import ShardedDict, Table, table
from kvtier.store.bookings import Bookings, Limits

K = TypeVar("K", bound=Hashable)
Refusal = Literal["held", "breaker_open", "policy"]
"""Why a copy to a lower tier is not started: the tier holds the chunk (or is writing or
deleting it), the tier is bypassed (breaker open), or its admission rules say no."""


class TierBooks:
    """One lower tier's placement state; every change is a method here."""

    def __init__(self, name: str, capacity: int, eviction: str, entries: int,
                 admission: Sequence[tuple[str, int]] = (), *, write_back: bool = False,
                 fits_slot: int | None = None,
                 available: Callable[[], bool] | None = None,
                 clock: Callable[[], float] | None = None, sharded: bool = True) -> None:
        """``sharded``: a server's books (:mod:`kvtier.shards`); False for the simulator's
        single-threaded replay, with the same results."""
        self.name = name
        self.write_back = write_back
        self.capacity = capacity
        """Bytes (chunks, for the simulator) the tier may hold, copies under way included."""
        self.policy: EvictionPolicy[Hashable] = make_eviction(eviction, entries, clock,
                                                              sharded=sharded)
        """The eviction order; retention deadlines are read against ``clock``."""
        self.admission: list[AdmissionPolicy] = make_admission(admission)
        self.counts_uses = any(type(r).record is not AdmissionPolicy.record
                               for r in self.admission)
        """Some rule counts uses (the base ``record`` does nothing: skipping it is free)."""
        self.fits_slot = fits_slot
        """The largest chunk an arena slot takes (``None``: any); a larger one is a miss."""
        self.available = available or _always
        """Whether reads and writes may go to the tier now (the store's breaker)."""
        self.sizes: ShardedDict[Hashable, int] | Table[Hashable, int] = table(sharded)
        """The size of each held chunk (sharded: a flood of peers' records never rehashes
        the whole index in one go, :mod:`kvtier.shards`)."""
        self.used = 0
        self.reserved = 0
        """Bytes promised to copies under way (:meth:`make_room` until :meth:`add`)."""
        self.deleting: set[Hashable] = set()
        """Keys whose delete is queued: not written again until it ran."""
        self.bookings = Bookings(name, Limits.of(capacity, fits_slot or 1))
        """Chunks held on a peer's word alone (not written, read or listed here)."""

    @property
    def books(self) -> TierBooks:
        return self

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    # ------------------------------------------------------------------ admission

    def record_use(self, rule_key: bytes) -> None:
        """One use of a chunk (a reserve or a lease of it), for the admission rules."""
        if self.counts_uses:
            for rule in self.admission:
                rule.record(rule_key)

    def admits(self, rule_key: bytes, priority: int, prefix_tokens: int) -> bool:
        return not self.admission or admits(
            self.admission, AdmissionContext(rule_key, priority, prefix_tokens))

    def refusal(self, key: Hashable, writing: bool, priority: int, prefix_tokens: int,
                rule_key: bytes | None = None) -> Refusal | None:
        """Why a copy of ``key`` (``writing``: one is under way) may not start; ``None``:
        it may. ``rule_key`` is what the admission rules see (default ``key``)."""
        if key in self.sizes or key in self.deleting or writing:
            return "held"  # a write racing a queued delete could be lost
        if not self.available():
            return "breaker_open"
        if self.admission and not self.admits(
                key if rule_key is None else rule_key, priority, prefix_tokens):  # type: ignore[arg-type]
            return "policy"
        return None

    # ------------------------------------------------------------------ room, victims

    def make_room(self, size: int, protected: Callable[[Hashable], bool],
                  forgot: list[Hashable] | None = None) -> list[Hashable] | None:
        """Evict until ``size`` more fit beside what is held and promised, and promise them.

        Returns the victims, already out of the books (the caller deletes them), or ``None``
        when the chunk cannot fit even after evicting every unprotected chunk (nothing is
        evicted then). Walks the eviction order lazily: the cost is the victims.

        Room is taken from bookings first, in eviction order: a booking is only forgotten
        (appended to ``forgot``), never a victim, since it exists on a peer's word alone and
        may be that peer's verified chunk (the tier's total is the sweeper's to enforce). A
        confirmed chunk is a victim, in eviction order, only for the room that the
        unprotected bookings cannot give.
        """
        if size > self.capacity:
            return None
        need = self.used + self.reserved + size - self.capacity
        victims: list[Hashable] = []
        if need > 0:
            chosen = self._choose(need, protected)
            if chosen is None:
                return None
            for key in chosen:
                size_of = self.sizes.pop(key)
                self.used -= size_of
                if key in self.bookings:
                    self.bookings.drop(key, size_of)
                    if forgot is not None:
                        forgot.append(key)
                else:
                    victims.append(key)
        self.reserved += size
        return victims

    def _choose(self, need: int, protected: Callable[[Hashable], bool]
                ) -> list[Hashable] | None:
        """Unprotected chunks worth ``need`` bytes, out of the eviction order (``None``:
        nothing changes): bookings first, then confirmed chunks for what they lack."""
        bookings = self.bookings
        if not bookings.count:
            return self.policy.evict_bytes(need, self.sizes.__getitem__, protected)

        def booked(key: Hashable) -> bool:
            return key in bookings and not protected(key)

        def confirmed(key: Hashable) -> bool:
            return key not in bookings and not protected(key)

        size_of = self.sizes.__getitem__
        chosen = self.policy.evict_bytes(need, size_of, lambda k: not booked(k))
        if chosen is not None:
            return chosen
        free = sum(self.sizes[key] for key in bookings.peer_of if booked(key))
        first = self.policy.evict_bytes(need - free, size_of, lambda k: not confirmed(k))
        if first is None:
            return None
        rest = need - sum(map(size_of, first))
        if rest <= 0:
            return first
        more = self.policy.evict_bytes(rest, size_of, lambda k: not booked(k))
        if more is None:  # cannot be: ``rest`` <= ``free``
            raise IntegrityError(f"tier {self.name}: bookings worth {free} bytes gave less")
        return first + more

    def release(self, promised: int) -> None:
        """A copy promised ``promised`` by :meth:`make_room` stored nothing."""
        self.reserved -= promised

    def add(self, key: Hashable, size: int, promised: int = 0,
            priority: int = DEFAULT_PRIORITY, parent: Hashable | None = None, *,
            peer: str | None = None, until: float | None = None) -> None:
        """A copy of ``key`` landed (``promised``: what :meth:`make_room` promised it);
        ``parent`` is the chunk before it in its chain (a policy hint); ``peer``: booked on
        that peer's word alone (check :meth:`Bookings.refusal` first); ``until``: when
        ``priority`` falls back to the default. A key held already
        (indexed meanwhile, e.g. by a listing) is re-added as new."""
        self.reserved -= promised
        self.forget(key)
        self.sizes[key] = size
        self.used += size
        self.policy.insert(key, priority, parent, until)
        if peer is not None:
            self.bookings.book(key, peer, size)

    def confirm(self, key: Hashable, size: int) -> None:
        """``key`` was read and verified here (``size``: its true size), or a listing found
        it: no longer a booking."""
        held = self.sizes.get(key)
        if held is None:
            return
        self.bookings.drop(key, held)
        self.sizes[key] = size
        self.used += size - held

    def forget(self, key: Hashable) -> bool:
        """Drop ``key`` from the books (deleted, lost); False if it was not held."""
        size = self.sizes.pop(key, None)
        if size is None:
            return False
        self.used -= size
        self.bookings.drop(key, size)
        self.policy.remove(key)
        return True

    def touch(self, key: Hashable) -> None:
        self.policy.touch(key)

    def set_priorities(self, keys: Sequence[Hashable], priority: int,
                       until: float | None = None) -> None:
        """Re-prioritise a prefix chain's held chunks (head first) until ``until``, keeping
        its order."""
        self.policy.set_priorities(keys, priority, until)

    def mark_deleting(self, key: Hashable) -> None:
        self.deleting.add(key)

    def clear_deleting(self, key: Hashable) -> None:
        self.deleting.discard(key)

    def set_capacity(self, capacity: int) -> None:
        """What the tier may hold from now on (learned from its free space)."""
        self.capacity = capacity

    def largest_table(self) -> int:
        """Keys in the largest hash table of these books: what one insert may rehash at once
        (sharded, :mod:`kvtier.shards`: a small share of the keys)."""
        return max(self.sizes.largest_shard(), self.bookings.peer_of.largest_shard(),
                   self.policy.largest_table())

    def check_integrity(self) -> None:
        if set(self.sizes) != set(self.policy.order()):
            raise IntegrityError(f"tier {self.name}: index and eviction policy disagree")
        if self.used != sum(self.sizes.values()):
            raise IntegrityError(f"tier {self.name}: used bytes {self.used} != sum of sizes")
        self.bookings.check_integrity(self.sizes)


def _always() -> bool:
    return True


class HasBooks(Protocol):
    @property
    def books(self) -> TierBooks: ...


T = TypeVar("T", bound=HasBooks)


def record_use(tiers: Iterable[HasBooks], rule_key: bytes) -> None:
    """One use of a chunk (a reserve or a lease), for every tier's admission rules."""
    for tier in tiers:
        tier.books.record_use(rule_key)


def write_targets(tiers: Iterable[T], key: Hashable, writing: Callable[[T], bool],
                  priority: int, prefix_tokens: int, rule_key: bytes | None = None,
                  refused: Callable[[T, Refusal], None] | None = None) -> list[T]:
    """The tiers among ``tiers`` a copy of ``key`` goes to (the caller passes the
    write-through tiers when a chunk is committed or used, the write-back ones when the
    arena evicts it): those that lack it, are available and admit it. ``writing(tier)``
    says whether a copy to ``tier`` is under way; ``refused`` hears every refusal."""
    out: list[T] = []
    for tier in tiers:
        why = tier.books.refusal(key, writing(tier), priority, prefix_tokens, rule_key)
        if why is None:
            out.append(tier)
        elif refused is not None:
            refused(tier, why)
    return out


def lower_source(tiers: Iterable[T], key: Hashable) -> T | None:
    """The lower tier a chunk without an arena slot is served from: the first, in lookup
    order, that holds it at a size a slot takes (a larger one was written by a server with
    bigger slots) while it is available."""
    for tier in tiers:
        books = tier.books
        size = books.sizes.get(key)
        if (size is not None and (books.fits_slot is None or size <= books.fits_slot)
                and books.available()):
            return tier
    return None


def servable_tiers(keys: Iterable[K], servable: Callable[[K], str | None]) -> list[str]:
    """The tier serving each chunk of the longest prefix of ``keys`` servable now: the
    first chunk that cannot be served ends the prefix (a prefix is useful from its head).
    What a lookup answers (a 128K-token lookup asks it for 512 keys under the store lock)."""
    tiers: list[str] = []
    for key in keys:
        tier = servable(key)
        if tier is None:
            break
        tiers.append(tier)
    return tiers


def servable_prefix(keys: Sequence[K], servable: Callable[[K], str | None]
                    ) -> list[tuple[K, str]]:
    """:func:`servable_tiers`, each tier with its key (what a lease takes)."""
    return list(zip(keys, servable_tiers(keys, servable), strict=False))


def make_slot(free: Callable[[], bool], victim: Callable[[], K | None],
              evict: Callable[[K], bool]) -> bool:
    """Make one arena slot free: evict one victim at a time until ``free()``. ``evict``
    says whether the victim's slot is free now; one written back first frees it only
    later, and then there is no slot this time (writing back the whole arena to find a
    clean chunk would stall the caller). False when no slot can be had now."""
    while not free():
        chosen = victim()
        if chosen is None or not evict(chosen):
            return False
    return True


def free_target(share: float, slots: int, write_back: bool) -> int:
    """Slots each commit keeps free or coming free (``share`` of ``slots``): only with a
    write-back tier, where freeing a slot means a write that had better start early."""
    return int(share * slots) if write_back else 0


def free_ahead(short: Callable[[], bool], victim: Callable[[], K | None],
               evict: Callable[[K], object]) -> None:
    """Evict while ``short()`` (fewer slots free or coming free than the arena's target),
    so that write-backs start before a reserve needs their slots."""
    while short():
        chosen = victim()
        if chosen is None:
            return
        evict(chosen)
