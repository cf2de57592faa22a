"""Replay a trace through the store's placement core (:mod:`kvtier.store.placement`).

Metadata only: a tier is the store's :class:`~kvtier.store.placement.TierBooks` (its eviction
policy, which also serves as the host's index, admission rules, sizes), a capacity in chunks
and a write policy. One trace block is one chunk of size 1, at the default priority (35)
unless its request carries a retention hint (:mod:`kvtier.trace.hints`). Every
decision (servable prefix, admission, write targets, victims, one victim per host slot, free
ahead) is the placement core's, as in the store; this module only sequences the steps and
lands each step's I/O when it ends. Per request with blocks ``b0 .. bn-1``, in the steps of
:class:`~kvtier.store.TieredStore` an engine makes (``lease``, ``reserve``, ``commit``)::

    1 lookup   the prefix is b0, b1, ... while each block is in some tier; each is one
               admission use; its host blocks are leased. Head first, each lower-tier block
               needs a host slot; none -> the prefix ends before it. Then tail first:
                 in host         -> touch it (a host hit); copy it down (below)
                 in a lower tier -> touch it in the first lower tier holding it (a hit
                                    there) and insert it into host
    2 reserve  each later block, head first: one admission use; in host -> touch it and
               copy it down; else a host slot for it (slots this reserve holds count and
               are never taken back), or it is skipped
    3 commit   the reserved blocks, tail first: insert into host, copy down; then, with a
               write-back tier, evict ahead until ``free_target`` of host is free or
               coming free

    copy down  to each write-through lower tier that lacks the chunk and admits it
    host slot  a free one, else evict one victim that is neither leased nor being copied
               down. A victim goes down to each write-back tier that lacks and admits it,
               and then keeps its slot until the copy is written: no slot this time
    room below a full lower tier evicts one victim at a time, never a chunk the lookup
               is promoting from it

    hints      a request's retention (priority, seconds) is the store's ``reserve`` and
               ``set_priority``: its stored blocks enter every tier at it, and once it is
               answered its whole prompt is set to it again, tail first, the duration
               counted from its arrival (a trace's clock); an end releases the prompt
               (priority 0). A retention set at finish (``finish``, the router's) is set
               instead, where it is stronger than what a block holds. Deadlines are
               read on the trace's clock. A promoted block keeps the retention of the
               tier it came from, a stored one the higher of the request's and a lower
               tier's, a copy down its host block's; a write-back victim goes down at
               the default (the store: at its own).

Tail first because a prefix is useful only from its head: within a step the head ends most
recent and the tail leaves first. The store's lower-tier I/O runs on its threads after the
step that started it; here it completes when that step ends. Until then a copy holds room in
its tier but cannot be evicted or touched there, a chunk evicted from a lower tier is not
written to it again (its delete is queued), and a write-back victim holds its host slot.
``tests/trace/test_trace_store_agreement.py`` replays traces through this and through a live
store, flushed after each step, and checks that the two sequences of steps match, request by
request.

So every block is one admission use per request (two where a lookup that found it had to
end before it). Hits are counted per tier that served them; :mod:`kvtier.trace.hits` turns
them into ratios.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvtier.config import ArenaConfig
from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_PRIORITY, MIN_PRIORITY, EvictionPolicy
from kvtier.store.placement import (
    TierBooks,
    free_ahead,
    free_target,
    lower_source,
    make_slot,
    record_use,
    servable_prefix,
    write_targets,
)
from kvtier.trace.formats import BlockId, Request
from kvtier.trace.hits import HitCounts
from kvtier.trace.results import SimResult, TierResult, WritePolicy

HOST = "host"
Held = tuple[int, float | None]
"""A chunk's retention: priority and deadline on the trace's clock (``None``: none)."""
PLAIN: Held = (DEFAULT_PRIORITY, None)
UNBOUNDED_POLICY_CAPACITY = 1 << 40
"""What an ``inf`` tier tells its policy: ghost lists sized from it never fill."""
UNBOUNDED_CHUNKS = 1 << 62
"""The capacity of an ``inf`` tier's books: never reached."""
DEFAULT_FREE_TARGET = ArenaConfig().free_target


@dataclass(frozen=True)
class TierSpec:
    """One simulated tier; ``capacity`` is in chunks, ``None`` for unbounded."""

    name: str
    capacity: int | None
    eviction: str = "lru"
    admission: tuple[tuple[str, int], ...] = ()
    write: WritePolicy = "through"
    free_target: float = DEFAULT_FREE_TARGET
    """Host only, with a write-back lower tier: the share of host slots each commit frees
    ahead (the store's ``arena.free_target``)."""

    def __post_init__(self) -> None:
        if self.capacity is not None and self.capacity < 0:
            raise ConfigError(f"tier {self.name}: capacity cannot be negative")
        if self.write not in ("through", "back"):
            raise ConfigError(f"tier {self.name}: write policy must be through or back")
        if not 0.0 <= self.free_target < 1.0:
            raise ConfigError(f"tier {self.name}: free_target must be in [0, 1)")


@dataclass
class _Tier:
    """A simulated tier: its placement books (the store's own, :mod:`kvtier.store.placement`),
    counts, and the copies and deletes the current step started."""

    spec: TierSpec
    books: TierBooks
    hits: int = 0
    written: int = 0
    evictions: int = 0
    writing: dict[Hashable, tuple[Hashable | None, Held]] = field(default_factory=dict)
    """Copies the current operation started, in order, with each chunk's chain parent and
    retention; they land when it ends."""

    @classmethod
    def build(cls, spec: TierSpec, clock: Callable[[], float] | None = None) -> _Tier:
        entries = spec.capacity if spec.capacity is not None else UNBOUNDED_POLICY_CAPACITY
        capacity = spec.capacity if spec.capacity is not None else UNBOUNDED_CHUNKS
        books = TierBooks(spec.name, capacity, spec.eviction, entries, spec.admission,
                          write_back=spec.write == "back", clock=clock, sharded=False)
        return cls(spec, books)

    @property
    def policy(self) -> EvictionPolicy[Hashable]:
        return self.books.policy


@dataclass
class _Lease:
    """What eviction must skip during one operation (a lookup, a reserve, a commit).

    Host chunks leased by the lookup or with a copy to a lower tier under way stay put; a
    chunk being promoted is also kept in the tier it is read from. The store protects
    exactly these (arena leases, ``writing``, ``reading``).
    """

    held: set[Hashable] = field(default_factory=set)
    reading: dict[Hashable, _Tier] = field(default_factory=dict)
    """Each chunk being promoted, with the lower tier it is read from."""


def admission_key(block: Hashable) -> bytes:
    """The bytes admission rules see: access-log ids as they are, Mooncake ints as 8 bytes."""
    if isinstance(block, bytes):
        return block
    if isinstance(block, int):
        return (block & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    raise TypeError(f"block ids are ints or bytes, got {type(block).__name__}")


class Simulator:
    """The tiers of one store configuration, replayed request by request."""

    def __init__(
        self, specs: Sequence[TierSpec], block_tokens: int, block_bytes: int | None = None
    ) -> None:
        if not specs or specs[0].name != HOST:
            raise ConfigError("the first tier must be host (the arena)")
        if len({s.name for s in specs}) != len(specs):
            raise ConfigError("tier names must be unique")
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.now = 0.0
        """The trace's clock: the arrival of the request being replayed."""
        self.priority = DEFAULT_PRIORITY
        self.until: float | None = None
        """The retention blocks stored now enter at (the current request's hint)."""
        self.hinted = False
        """Some request carried a hint: retentions are looked up per chunk from then on
        (an unhinted replay never pays for it)."""
        self.tiers = [_Tier.build(s, self._clock) for s in specs]
        self.host = self.tiers[0]
        self.lower = self.tiers[1:]
        self.by_name = {t.spec.name: t for t in self.lower}
        self.through = [t for t in self.lower if t.spec.write == "through"]
        self.back = [t for t in self.lower if t.spec.write == "back"]
        self.recorders = [t for t in self.lower if t.books.counts_uses]
        self.rules = any(t.books.admission for t in self.lower)
        """Some lower tier has admission rules (they see ``admission_key`` of a block)."""
        self.counts = HitCounts()
        self._depth: dict[Hashable, tuple[int, Hashable | None]] = {}
        """Block index in its request (for write-back admission) and chain parent; kept
        while in host."""
        self._demoting: dict[Hashable, bool] = {}
        """Host victims being written back: their slots are free once the step ends, unless
        (True) a write-through copy started meanwhile still reads them: then they stay."""
        capacity = self.host.spec.capacity
        self._free_target = 0 if capacity is None else free_target(
            self.host.spec.free_target, capacity, bool(self.back))

    def replay(self, requests: Iterable[Request]) -> SimResult:
        start = time.perf_counter()
        for request in requests:
            self.request(request)
        return self.result(time.perf_counter() - start)

    def request(self, request: Request) -> list[str]:
        """Replay one request; returns the tier that served each block of its prefix."""
        self.now = request.ts_s
        hinted = request.retention is not None or request.end or request.finish is not None
        if hinted:
            self.hinted = True
            self._hint(request)
        served = self._load(request.blocks)
        self._store(request.blocks, len(served))
        self.counts.add(request, len(served))
        if hinted:
            self._answered(request)
        return served

    def _clock(self) -> float:
        return self.now

    def _hint(self, request: Request) -> None:
        if request.retention is not None:
            self.priority, self.until = self._from_now(*request.retention)

    def _answered(self, request: Request) -> None:
        """The connector's ``set_priority`` once the request is answered (tail first): its
        whole prompt released; or the retention for how it ended (``finish``), else its own
        retention, where that is stronger than what a block holds (``keep_stronger``:
        another request's longer retention stays)."""
        if request.end:
            for tier in self.tiers:
                tier.books.set_priorities(list(request.blocks), MIN_PRIORITY, None)
        elif request.finish is not None:
            self._keep_stronger(request.blocks, self._from_now(*request.finish))
        else:
            self._keep_stronger(request.blocks, (self.priority, self.until))
        self.priority, self.until = DEFAULT_PRIORITY, None

    def _from_now(self, priority: int, duration: float | None) -> Held:
        """A retention of ``duration`` seconds from now, as (priority, deadline)."""
        return priority, (None if duration is None or priority == DEFAULT_PRIORITY
                          else self.now + duration)

    def _keep_stronger(self, blocks: tuple[BlockId, ...], wanted: Held) -> None:
        """``blocks`` to ``wanted`` in every tier (tail first), where it is stronger than what
        a block holds."""
        stronger = _lasting(wanted)
        for tier in self.tiers:
            policy = tier.books.policy
            tier.books.set_priorities([b for b in blocks if (held := policy.retention(b))
                                       is not None and _lasting(held) < stronger], *wanted)

    def _servable(self, block: Hashable) -> str | None:
        """The store's predicate with every step's I/O landed: host, else a lower tier."""
        if block in self.host.books.policy:
            return HOST
        source = lower_source(self.lower, block)
        return None if source is None else source.spec.name

    def _load(self, blocks: tuple[BlockId, ...]) -> list[str]:
        """Serve the present prefix as the store's ``lease`` does: the serving tier of each
        block, head first."""
        found = servable_prefix(blocks, self._servable)
        prefix = len(found)
        lease = _Lease(held={b for b, tier in found if tier == HOST})
        sources = lease.reading
        room = self._room(lease, lambda: len(sources))
        for j, (block, tier) in enumerate(found):
            if tier == HOST:
                continue
            if not room():
                prefix = j  # no slot for it: the lease ends before this chunk
                break
            sources[block] = self.by_name[tier]
        if self.recorders:  # one use per leased chunk (a chunk cut off is offered later)
            for block in blocks[:prefix]:
                record_use(self.recorders, admission_key(block))
        served = [HOST] * prefix
        host = self.host.books.policy
        if not sources and not self.through:  # all in host, nothing to copy: just touch
            touch = host.touch
            for j in reversed(range(prefix)):  # tail first: the head ends most recent
                touch(blocks[j])
            self.host.hits += prefix
            self._complete_io()
            return served
        for j in reversed(range(prefix)):  # tail first: the head ends most recent
            block = blocks[j]
            source = sources.get(block)
            if source is None:
                host.touch(block)
                self.host.hits += 1
                self._write_through(blocks, j, lease)
            else:
                source.books.touch(block)
                source.hits += 1
                held = source.books.policy.retention(block) if self.hinted else None
                self._put_host(blocks, j, held or PLAIN)  # a promotion keeps its own
                served[j] = source.spec.name
        self._complete_io()
        return served

    def _store(self, blocks: tuple[BlockId, ...], start: int) -> None:
        """Blocks after the served prefix were recomputed: ``reserve`` then ``commit``."""
        host = self.host.books.policy
        lease = _Lease()  # nothing is leased now, but chunks being copied down stay put
        pending: list[int] = []
        room = self._room(lease, pending.__len__)
        for j in range(start, len(blocks)):
            block = blocks[j]
            if self.recorders:
                record_use(self.recorders, admission_key(block))
            if block in host:
                host.touch(block)
                self._write_through(blocks, j, lease)
            elif block in self._demoting:  # still in its slot, on its way down: servable
                self._demoting[block] = self._write_through(blocks, j, lease)
            elif room():
                pending.append(j)
        self._complete_io()
        lease = _Lease()  # the reserve's copies have landed
        for j in reversed(pending):  # commit inserts tail first
            self._put_host(blocks, j, self._entering(blocks[j]))
            self._write_through(blocks, j, lease)
        self._free_ahead(lease)
        self._complete_io()

    def _write_through(self, blocks: tuple[BlockId, ...], index: int, lease: _Lease) -> bool:
        """Copy ``blocks[index]`` to each write-through tier that lacks and admits it; True
        if any copy was started."""
        if not self.through:
            return False
        started = False
        block = blocks[index]
        held = (self.host.books.policy.retention(block) or PLAIN) if self.hinted else PLAIN
        for tier in self._targets(self.through, block, index, held[0]):
            if self._insert(tier, block, _parent(blocks, index), lease, held):
                lease.held.add(block)  # its slot is being read: the store pins it
                started = True
        return started

    def _targets(self, tiers: list[_Tier], block: Hashable, index: int,
                 priority: int = DEFAULT_PRIORITY) -> list[_Tier]:
        rule_key = admission_key(block) if self.rules else None
        return write_targets(tiers, block, lambda t: block in t.writing, priority,
                             (index + 1) * self.block_tokens, rule_key)

    def _complete_io(self) -> None:
        """The copies the operation started land, in the order it started them, its deletes
        run and the slots of its write-back victims come free (the store's I/O finishes
        after the operation that started it)."""
        for tier in self.lower:
            books = tier.books
            if tier.writing:
                for block, (parent, (priority, until)) in tier.writing.items():
                    books.add(block, 1, 1, priority, parent, until=until)
                tier.writing.clear()
            for block in list(books.deleting):
                books.clear_deleting(block)
        for block, still_read in self._demoting.items():
            if still_read:  # the store's _demoted: back into the host's eviction order
                self.host.books.policy.insert(block, DEFAULT_PRIORITY, self._depth[block][1])
            else:
                del self._depth[block]
        self._demoting.clear()

    def _entering(self, block: Hashable) -> Held:
        """The retention a stored block enters host at: the request's, or a higher one a
        lower tier holds it at (the store's ``reserve``)."""
        held = (self.priority, self.until)
        if not self.hinted:
            return held
        for tier in self.lower:
            below = tier.books.policy.retention(block)
            if below is not None and _lasting(below) > _lasting(held):
                held = below
        return held

    def _put_host(self, blocks: tuple[BlockId, ...], index: int, held: Held) -> None:
        block, parent = blocks[index], _parent(blocks, index)
        self.host.books.policy.insert(block, held[0], parent, held[1])
        self.host.written += 1
        if self.back:
            self._depth[block] = (index, parent)

    def _insert(self, tier: _Tier, block: Hashable, parent: Hashable | None,
                lease: _Lease, held: Held = PLAIN) -> bool:
        """Start a copy of ``block`` to lower ``tier`` if room can be made for it (never
        evicting a chunk the lease promotes from it)."""
        reading = lease.reading
        victims = tier.books.make_room(1, lambda b: reading.get(b) is tier)
        if victims is None:
            return False
        for victim in victims:  # its delete runs when the step ends
            tier.books.mark_deleting(victim)
        tier.evictions += len(victims)
        tier.writing[block] = (parent, held)
        tier.written += 1
        return True

    def _room(self, lease: _Lease, pending: Callable[[], int]) -> Callable[[], bool]:
        """A host slot beside the ``pending()`` ones held but not inserted yet (the store's
        ``make_slot``): one unprotected victim at a time; none when a victim must be
        written back first."""
        capacity = self.host.spec.capacity
        if capacity is None:
            return lambda: True
        host, demoting = self.host.books.policy, self._demoting
        victim = functools.partial(self._host_victim, lease)
        evict = functools.partial(self._evict_host, lease)

        def free() -> bool:
            return len(host) + pending() + len(demoting) < capacity

        return lambda: make_slot(free, victim, evict)

    def _free_ahead(self, lease: _Lease) -> None:
        """After a commit, keep ``free_target`` host slots free or coming free."""
        capacity = self.host.spec.capacity
        if capacity is None or not self._free_target:
            return
        host, target = self.host.books.policy, self._free_target
        free_ahead(lambda: capacity - len(host) < target,
                   functools.partial(self._host_victim, lease),
                   functools.partial(self._evict_host, lease))

    def _host_victim(self, lease: _Lease) -> Hashable | None:
        victims = self.host.books.policy.evict(1, lease.held.__contains__)
        return victims[0] if victims else None

    def _evict_host(self, lease: _Lease, block: Hashable) -> bool:
        """A host victim leaves; True if its slot is free now."""
        self.host.evictions += 1
        return not self._demote(block, lease)

    def _demote(self, block: Hashable, lease: _Lease) -> bool:
        """Copy a host victim to every write-back tier that lacks and admits it; True if a
        copy was started (the victim then keeps its slot until the step ends)."""
        if not self.back:
            return False
        index, parent = self._depth[block]
        started = False
        for tier in self._targets(self.back, block, index):
            started = self._insert(tier, block, parent, lease) or started
        if started:
            self._demoting[block] = False
        else:
            del self._depth[block]
        return started

    def result(self, elapsed_s: float = 0.0) -> SimResult:
        tiers = tuple(self._tier_result(t) for t in self.tiers)
        counts = replace(self.counts)
        return SimResult(counts, tiers, self.block_tokens, self.block_bytes, elapsed_s)

    def _held(self, block: Hashable) -> bool:
        return any(block in t.books.policy for t in self.tiers)

    def _tier_result(self, tier: _Tier) -> TierResult:
        total = self.counts.prompt_blocks
        size = self.block_bytes
        return TierResult(
            name=tier.spec.name,
            capacity_chunks=tier.spec.capacity,
            eviction=tier.spec.eviction,
            admission=tier.spec.admission,
            write=tier.spec.write,
            hits=tier.hits,
            hit_ratio=tier.hits / total if total else 0.0,
            blocks_written=tier.written,
            blocks_read=tier.hits,
            bytes_written=None if size is None else tier.written * size,
            bytes_read=None if size is None else tier.hits * size,
            evictions=tier.evictions,
            unreachable=tier.books.policy.unreachable(self._held),
        )


def _lasting(held: Held) -> tuple[int, float]:
    """The store's order of retentions: higher priority, then later deadline (none last)."""
    return held[0], float("inf") if held[1] is None else held[1]


def _parent(blocks: tuple[BlockId, ...], index: int) -> BlockId | None:
    """The chunk before ``blocks[index]`` in its chain (the policy's ``parent`` hint)."""
    return blocks[index - 1] if index else None


def simulate(
    requests: Iterable[Request],
    specs: Sequence[TierSpec],
    block_tokens: int,
    block_bytes: int | None = None,
) -> SimResult:
    """Replay ``requests`` through fresh tiers built from ``specs``."""
    return Simulator(specs, block_tokens, block_bytes).replay(requests)
