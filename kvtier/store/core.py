"""The tiered store's public operations, orchestrating the components that own the state.

::

    TieredStore (this file: the operations; the only code that takes the one lock)
      ├── ArenaIndex      arena slots, the chunk (Entry) in each, their eviction order
      ├── Holdings        reservations: key -> owner, deadline
      ├── LeaseTable      leases: id -> items, owner, deadline; waiters per key
      ├── LowerTierState  per lower tier: books, policy, admission, I/O pool, breaker, speed;
      │     │             announces each change of what it holds to its listeners:
      │     ├── EventLog  what became servable or left, per tier (engines' KV events)
      │     └── Sharing   a shared tier's books kept in step with other servers' (journal)
      ├── Writes          arena -> lower tiers (through, back, demotion), deletes; arena room
      ├── Promotions      lower tier -> arena, for leases
      ├── Loads           the lease of a prefix, its release (lock held)
      └── Housekeeper     the periodic work on the lower tiers

Components that finish work on other threads change state through :meth:`TieredStore.apply`
(:mod:`kvtier.store.locking`), which times every hold of the lock.

Operations clients see:

- ``lookup(keys)``: the tier of each chunk of the longest prefix available now, with the
  estimated arrival of each (:meth:`lookup_hit`). No side effects. The same predicate
  (:meth:`_servable`) decides what ``lease`` grants, so a planned hit is a granted one.
- ``reserve`` -> client writes payloads into the slots -> ``commit`` (or ``abort``): the
  two-phase store. Commit makes chunks servable and starts write-through copies below.
- ``lease`` -> (``wait`` while lower-tier chunks are promoted) -> client reads -> ``release``:
  the two-phase load. A leased or in-flight slot is never evicted or reused.
- ``drop_owner``/``resume_owner``/``expire``: leases and reservations end after their TTL,
  or a grace period after their client went away, unless it comes back in time.

Keys in one call must be distinct (a chain of content hashes never repeats); a request that
breaks a rule raises :class:`~kvtier.errors.InvalidRequest` before anything changes. Lock
holds are microseconds of dict and policy work; all I/O runs on the tiers' pools.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from kvtier.auth import Keyring, load_keyring
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError, InvalidRequest, TierError
from kvtier.keys import ChunkKey
from kvtier.metrics import StoreMetrics
from kvtier.policies import (
    DEFAULT_PRIORITY,
    MIN_PRIORITY,
    EvictionPolicy,
    Retention,
    check_duration,
    check_priority,
)
from kvtier.store import views
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.breaker import BreakerState
from kvtier.store.checks import check_keys, check_reserve
from kvtier.store.events import Event, EventLog
from kvtier.store.holdings import Holdings
from kvtier.store.housekeeping import Housekeeper
from kvtier.store.integrity import check_store
from kvtier.store.leases import LeaseTable
from kvtier.store.loads import Loads
from kvtier.store.locking import Hold, StoreLock
from kvtier.store.lower import LowerTierState
from kvtier.store.placement import (
    free_target,
    lower_source,
    record_use,
    servable_prefix,
    servable_tiers,
)
from kvtier.store.promotions import Promotions
from kvtier.store.quotas import Quotas
from kvtier.store.records import Entry, LeaseRecord, Where
from kvtier.store.scan import bounded_scan, newest_that_fit
from kvtier.store.sharing import Sharing
from kvtier.store.writes import Writes
from kvtier.tiers.arena import Arena

log = logging.getLogger("kvtier.store")
ARENA = "arena"
EXPIRE_BATCH = 64
T = TypeVar("T")


@dataclass(frozen=True)
class Hit:
    """What a lookup found: the tier of each chunk of the prefix and when it could be in
    the arena (seconds from now, estimated from each tier's measured read speed)."""

    tiers: list[str]
    arrival_s: list[float]


class TieredStore:
    def __init__(self, config: ServerConfig, *, arena_name: str,
                 metrics: StoreMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 instance: str | None = None,
                 keyring: Keyring | Literal["config"] | None = "config") -> None:
        self.config = config
        self.keyring = (load_keyring(config.auth.shared_secret_env, config.auth.shared_secret_file)
                        if keyring == "config" else keyring)
        """The cluster secret(s) for shared tiers (docs/security.md); from ``config.auth``
        unless given."""
        self.instance = instance or secrets.token_hex(8)
        """Random per start: names this server in hellos and on shared tiers."""
        self.metrics = metrics or StoreMetrics()
        self.clock = clock
        self._lock = StoreLock()
        self.lock_max_s = self._lock.max_s
        """The longest hold of the store lock per operation, wall time (see
        :class:`~kvtier.store.locking.StoreLock`)."""
        self.lock_cpu_max_s = self._lock.cpu_max_s
        self.lock_holds = self._lock.holds
        """Holds of the store lock per section so far."""
        self.events = EventLog()
        """What became servable in which tier, and what left (for engines' KV events)."""
        self.index = ArenaIndex(config.arena, arena_name, self.events, clock)
        try:
            self.tiers = [self._tier(i) for i in range(len(config.tiers))]
        except BaseException:
            self.index.arena.close()
            self.index.arena.unlink()
            raise
        self.tiers_by_name = {state.name: state for state in self.tiers}
        self.reservations: Holdings[ChunkKey] = Holdings()
        self.leases = LeaseTable()
        self.promotions = Promotions(self.index, self.leases, self.metrics, self.apply, clock,
                                     self.keyring)
        self.quotas = Quotas(config.retention_quotas, self.metrics)
        """Bytes each tenant may hold above the default priority, per tier."""
        if config.retention_quotas is not None:
            for warning in config.retention_quotas.warnings(config.capacities()):
                log.warning("%s", warning)
        self.writes = Writes(self.index, self.tiers, self.metrics, self.apply, self._reading,
                             self.keyring, self.quotas)
        self.loads = Loads(self.index, self.leases, self.promotions, self.writes, self.tiers,
                           self.metrics)
        write_back = any(t.write_back for t in self.tiers)
        ac = config.arena
        self._free_target = free_target(ac.free_target, ac.num_slots, write_back)
        self._housekeeper = Housekeeper(self.tiers, self.apply, self.clock, self.instance)
        self._closed = False
        self.sharing: dict[str, Sharing] = {}
        """Per shared tier (by name): its journal, sweeps and heartbeats."""
        for state in self.tiers:
            state.subscribe(self.events)
            if state.tier.shared:
                sharing = Sharing(state, self.instance, self.apply, self._reading,
                                  self._swept, self.keyring, self._untrusted,
                                  self._bookings_refused)
                state.subscribe(sharing)
                self.sharing[state.name] = sharing
                sharing.start()
        self._set_gauges()

    def _tier(self, index: int) -> LowerTierState:
        config = self.config.tiers[index]

        def on_change(old: BreakerState, new: BreakerState, reason: str) -> None:
            self._breaker_changed(config.name, old, new, reason)

        try:
            return LowerTierState(config, self.config.arena.slot_bytes, self.clock, on_change)
        except ConfigError as exc:
            raise ConfigError(f"tiers[{index}]: {exc}") from exc

    @property
    def arena(self) -> Arena:
        return self.index.arena

    @property
    def policy(self) -> EvictionPolicy[Hashable]:
        """The arena's eviction order."""
        return self.index.policy

    @property
    def entries(self) -> dict[ChunkKey, Entry]:
        return self.index.entries

    def _locked(self, section: str) -> contextlib.AbstractContextManager[Hold]:
        """Hold the store lock, the hold timed under ``section`` (a wait on the store,
        ``hold.wait``, ends one timed hold and waking up begins the next)."""
        return self._lock.held(section)

    def apply(self, section: str, change: Callable[[], T], *, wake: bool = False) -> T:
        """Run ``change`` under the store lock (timed under ``section``); returns what it
        returned. The one way other threads' work (I/O outcomes, housekeeping, journals)
        changes the store's state. ``wake``: the change may end what :meth:`wait` or
        :meth:`flush` waits for (a write, delete or promotion done or abandoned), so wake
        them; books-only changes (journals, touches, breakers) leave them asleep."""
        with self._locked(section) as hold:
            out = change()
            if wake:
                hold.notify_all()
        return out

    # ------------------------------------------------------------------ start

    def rebuild(self) -> int:
        """Index what the lower tiers already hold (after a restart). Returns chunk count.

        A tier whose listing fails or stalls (see :mod:`kvtier.store.scan`) starts empty with
        its breaker open; the server serves from the arena and the other tiers meanwhile.
        """
        count = sum(self._rebuild_tier(state) for state in self.tiers)
        self._set_gauges()
        return count

    def _rebuild_tier(self, state: LowerTierState) -> int:
        started_ms = int(time.time() * 1000)
        try:
            space, listed = bounded_scan(state)
        except TierError as exc:
            self._unlisted(state, exc)
            return 0
        state.learn_space(space)
        usable, odd = state.plausible_only(listed)
        sharing = self.sharing.get(state.name)
        if sharing is not None:  # others' chunks too; budgets are the sweeper's
            sharing.listed(started_ms)
            room = sum(c.size for c in usable)
        else:
            room = state.capacity - state.used
        kept, left = newest_that_fit(usable, room)  # if the tier shrank, the oldest go
        if sharing is None:  # this node's own files that no slot here can take
            left += odd
        with self._locked("rebuild"):
            state.count_implausible(len(odd))
            for chunk in left:
                self.writes.delete_later(state, chunk.key, chunk.namespace)
            sizes: dict[Hashable, int] = {c.key: c.size for c in kept
                                          if c.priority > DEFAULT_PRIORITY}
            pinned = list(sizes)[:self.quotas.relisted(state.name, list(sizes),
                                                       sizes.__getitem__, state.pinned)]
            pins = set(pinned)  # a pin whose tenant is not known: see Quotas.relisted
            for chunk in kept:
                priority = chunk.priority if chunk.key in pins else min(chunk.priority,
                                                                        DEFAULT_PRIORITY)
                state.index(chunk.key, chunk.size, priority, chunk.namespace)
        log.info("tier %s: indexed %d chunks, %d bytes", state.name, len(state.sizes),
                 state.used)
        return len(kept)

    def _unlisted(self, state: LowerTierState, exc: TierError) -> None:
        """The tier could not be listed at start: bypass it until a probe passes, then fill
        its books (a shared tier by listing it again, a node-local one by a rescan)."""
        log.warning("tier %s: cannot list what it holds at start (%s); starting with it "
                    "empty and bypassed until it answers again", state.name, exc)
        with self._locked("rebuild"):
            state.unlisted(f"listing at start failed: {exc}")

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[ChunkKey]) -> list[str]:
        """The tier holding each chunk of the longest prefix of ``keys`` available now."""
        return self.lookup_hit(keys).tiers

    def lookup_hit(self, keys: Sequence[ChunkKey]) -> Hit:
        check_keys(keys)
        now = self.clock()
        with self._locked("lookup"):
            tiers = servable_tiers(keys, self._servable)
            arrivals = self._arrivals(tiers, now)
        self.metrics.lookup_chunks.labels("hit").inc(len(tiers))
        self.metrics.lookup_chunks.labels("miss").inc(len(keys) - len(tiers))
        return Hit(tiers, arrivals)

    def _prefix(self, keys: Sequence[ChunkKey]) -> list[tuple[ChunkKey, str]]:
        """The longest servable prefix of ``keys``, each with its tier (lock held)."""
        return servable_prefix(keys, self._servable)

    def _servable(self, key: ChunkKey) -> str | None:
        """Where ``key`` can be leased from now (None: it cannot): the one predicate of
        both lookup and lease."""
        entry = self.index.get(key)
        if entry is not None:
            if entry.where is Where.READY:
                return ARENA
            if self.promotions.joinable(entry):
                return entry.reading
            return None  # being written by a client, or a read that hangs
        source = lower_source(self.tiers, key)
        return None if source is None else source.name

    def _arrivals(self, tiers: list[str], now: float) -> list[float]:
        out: list[float] = []
        per_tier: dict[str, int] = {}
        for tier in tiers:
            if tier != ARENA:
                per_tier[tier] = per_tier.get(tier, 0) + 1
        estimates = {name: iter(self.tiers_by_name[name].reads.arrivals(
            count, self.tiers_by_name[name].pool.queued, self.tiers_by_name[name].config.io_threads,
            now)) for name, count in per_tier.items()}
        for tier in tiers:
            out.append(0.0 if tier == ARENA else next(estimates[tier]))
        return out

    # ------------------------------------------------------------------ two-phase store

    def reserve(self, owner: int, namespace_fp: bytes, keys: Sequence[ChunkKey], *,
                payload_len: int, tokens: int, priority: int = DEFAULT_PRIORITY,
                first_index: int = 0, retain_s: float | None = None,
                tenant: str | None = None) -> list[int | None]:
        """A slot for each key to write its payload into; ``None`` means skip that chunk
        (already stored or being stored, or no room). The chunks are kept at ``priority``
        for ``retain_s`` seconds (``None``: until changed), then at the default; those
        beyond ``tenant``'s quota in the arena (:mod:`kvtier.store.quotas`) at the default.

        Raises InvalidRequest when the payload cannot fit a slot or a value is out of range.
        """
        check_reserve(namespace_fp, keys, payload_len, tokens, priority, first_index,
                      self.index.arena.slot_bytes)
        retention = _retention(priority, retain_s)
        now = self.clock()
        deadline = now + self.config.lease_ttl_s
        until = retention.until(now)
        slots: list[int | None] = []
        with self._locked("reserve"):
            pinned = len(keys)
            if priority > DEFAULT_PRIORITY:
                slot_bytes = self.index.arena.slot_bytes
                pinned = self.quotas.admit(tenant, ARENA, keys, lambda _: slot_bytes,
                                           self.index.pinned)
            try:
                for i, key in enumerate(keys):
                    asked = (priority, until) if i < pinned else (DEFAULT_PRIORITY, None)
                    slots.append(self._reserve_one(owner, key, deadline, namespace_fp,
                                                   tokens, payload_len, asked,
                                                   (first_index + i + 1) * tokens))
            except BaseException:
                for key, slot in zip(keys, slots, strict=False):  # all or nothing
                    if slot is not None:
                        self._abort_one(key, None)
                raise
        return slots

    def _reserve_one(self, owner: int, key: ChunkKey, deadline: float, namespace_fp: bytes,
                     tokens: int, payload_len: int, retention: tuple[int, float | None],
                     prefix_tokens: int) -> int | None:
        record_use(self.tiers, key)
        entry = self.index.get(key)
        if entry is not None:
            if entry.where is Where.READY:
                self.index.touch(key)
                self.writes.through(entry)
            self.metrics.store_refusals.labels("present").inc()
            return None
        priority, until = retention
        for state in self.tiers:  # a lower tier's pin, within the arena quota of its tenant
            kept = state.policy.retention(key)
            if kept is not None and _lasting(kept) > _lasting((priority, until)):
                priority, until = max((priority, until), self.writes.carried(
                    state.name, None, key, self.index.arena.slot_bytes, kept), key=_lasting)
        entry = self.writes.take(key, Where.RESERVED, priority, until)
        if entry is None:
            self.metrics.store_refusals.labels("arena_full").inc()
            return None
        self.index.describe(entry, namespace_fp, tokens, payload_len, prefix_tokens)
        try:
            self.reservations.add(key, owner, deadline)
        except BaseException:
            self.index.drop(entry)
            raise
        return entry.slot

    def commit(self, keys: Sequence[ChunkKey], owner: int | None = None) -> int:
        """Publish reserved chunks; returns how many were committed.

        Only the reserving client's (``owner``'s) reservations; ``None`` for in-process
        callers. Chunks are inserted tail first, so the head of a prefix is the most
        recently used.
        """
        check_keys(keys)
        count = 0
        with self._locked("commit") as hold:
            for key in reversed(keys):
                if not self.reservations.held_by(key, owner):
                    continue
                entry = self.index.entries[key]
                self.index.publish(entry)
                self.reservations.remove(key)
                self.writes.through(entry)
                count += 1
            self.writes.free_ahead(self._free_target)
            hold.notify_all()
        self._set_gauges()
        return count

    def abort(self, keys: Sequence[ChunkKey], owner: int | None = None) -> int:
        """Drop reserved chunks of ``owner`` (any, for ``None``); returns how many."""
        check_keys(keys)
        with self._locked("abort") as hold:
            count = sum(self._abort_one(key, owner) for key in keys)
            hold.notify_all()
        return count

    def _abort_one(self, key: ChunkKey, owner: int | None) -> bool:
        if not self.reservations.held_by(key, owner):
            return False
        self.reservations.remove(key)
        self.index.drop(self.index.entries[key])
        return True

    def set_priority(self, keys: Sequence[ChunkKey], priority: int,
                     retain_s: float | None = None, *, keep_stronger: bool = False,
                     tenant: str | None = None) -> None:
        """Move the held chunks of ``keys`` (a prefix, head first) to ``priority`` in every
        tier, for ``retain_s`` seconds (``None``: until changed), tail first, so that the
        chain still leaves tail first. A release is priority 0. With ``keep_stronger``, a
        chunk held stronger in a tier (:func:`_lasting`) keeps what it has there. Above the
        default, only the head of the chain within ``tenant``'s quota in each tier moves
        (:mod:`kvtier.store.quotas`)."""
        check_keys(keys)
        retention = _retention(priority, retain_s)
        with self._locked("set_priority"):  # tail first: the chain keeps its order
            until = retention.until(self.clock())
            wanted = _lasting((priority, until))
            held = keys
            if keep_stronger:
                held = [k for k in keys if (e := self.index.get(k)) is not None
                        and _lasting(self.index.retention(e)) < wanted]
            if priority > DEFAULT_PRIORITY:
                held = self._within_quota(tenant, ARENA, held, self.index.pinned)
            self.index.set_priorities(held, priority, until)
            for state in self.tiers:
                held = keys
                if keep_stronger:
                    held = [k for k in keys if (r := state.policy.retention(k)) is not None
                            and _lasting(r) < wanted]
                if priority > DEFAULT_PRIORITY:
                    held = self._within_quota(tenant, state.name, held, state.pinned)
                state.set_priorities(held, priority, until)
        if priority == MIN_PRIORITY:
            self.metrics.retention_releases.inc(len(keys))
        self._set_gauges()

    def _within_quota(self, tenant: str | None, tier: str, keys: Sequence[ChunkKey],
                      pinned: Callable[[Hashable], bool]) -> Sequence[ChunkKey]:
        """The head of ``keys`` that ``tenant`` may pin in ``tier`` (lock held)."""
        if not self.quotas.active:
            return keys
        if tier == ARENA:
            slot_bytes = self.index.arena.slot_bytes
            present = [k for k in keys if k in self.index.entries]
            return present[:self.quotas.admit(tenant, tier, present, lambda _: slot_bytes,
                                              pinned)]
        sizes = self.tiers_by_name[tier].books.sizes
        present = [k for k in keys if k in sizes]
        return present[:self.quotas.admit(tenant, tier, present, lambda k: sizes[k], pinned)]

    # ------------------------------------------------------------------ two-phase load

    def lease(self, owner: int, keys: Sequence[ChunkKey]) -> LeaseRecord:
        """Lease the longest available prefix of ``keys``; lower-tier chunks of it are
        promoted (see :meth:`kvtier.store.loads.Loads.lease`)."""
        check_keys(keys)
        deadline = self.clock() + self.config.lease_ttl_s
        with self._locked("lease"):
            record = self.loads.lease(owner, self._prefix(keys), deadline)
            retained = [self._retained(item.key) for item in record.items]
        for item, kept in zip(record.items, retained, strict=True):
            self.metrics.hits.labels(item.tier).inc()
            self.metrics.retained_hits.labels(item.tier, kept).inc()
        return record

    def _retained(self, key: ChunkKey) -> str:
        """``yes`` if the leased chunk is held above the default priority now (lock held)."""
        entry = self.index.get(key)
        held = entry is not None and self.index.retention(entry)[0] > DEFAULT_PRIORITY
        return "yes" if held else "no"

    def wait(self, lease_id: int, timeout_s: float, owner: int | None = None) -> LeaseRecord:
        """Block until the lease has no pending chunk or the timeout passes.

        Waiting renews the lease: a client that asks is alive."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._locked("wait") as hold:
            record = self.leases.get(lease_id, owner)
            self.leases.renew(lease_id, self.clock() + self.config.lease_ttl_s)
            while not record.done and not self._closed and not record.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                hold.wait(left)
            return record

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """End a lease of ``owner`` (any, for ``None``); InvalidRequest for another's."""
        with self._locked("release") as hold:
            self.loads.release(lease_id, owner)
            hold.notify_all()

    def renew(self, lease_id: int) -> None:
        with self._locked("renew"):
            self.loads.renew(lease_id, self.clock() + self.config.lease_ttl_s)

    # ------------------------------------------------------------------ lower tiers' callbacks

    def _reading(self, state: LowerTierState, key: Hashable) -> bool:
        entry = self.index.entries.get(key)  # type: ignore[call-overload]
        return entry is not None and entry.reading == state.name

    # ------------------------------------------------------------------ clients coming, going

    def drop_owner(self, owner: int) -> None:
        """A client went away: its leases and reservations end after ``orphan_grace_s``.

        Not at once: the client may have handed slot numbers to another process (an engine
        worker) that is still copying; a slot reused under it would be a wrong block. A
        client that comes back in time (:meth:`resume_owner`) keeps them.
        """
        now = self.clock()
        with self._locked("drop_owner"):
            end = now + self.config.orphan_grace_s
            self.leases.holdings.cap_owner(owner, end)
            self.reservations.cap_owner(owner, end)
        if self.config.orphan_grace_s == 0:
            self.expire(now)

    def resume_owner(self, owner: int) -> None:
        """A client that went away is back: what it holds lives a full TTL again."""
        with self._locked("resume_owner"):
            deadline = self.clock() + self.config.lease_ttl_s
            self.leases.holdings.renew_owner(owner, deadline)
            self.reservations.renew_owner(owner, deadline)

    def expire(self, now: float | None = None) -> None:
        """Drop leases and reservations past their deadline; costs what expired, in batches
        of EXPIRE_BATCH per lock hold (a burst of expiries never stalls other clients)."""
        now = self.clock() if now is None else now
        while True:
            with self._locked("expire") as hold:
                records = self.leases.expired(now, EXPIRE_BATCH)
                for record in records:
                    self.loads.unpin(record)
                reserved = self.reservations.expired(now, EXPIRE_BATCH)
                for key in reserved:
                    self.index.drop(self.index.entries[key])
                if records or reserved:
                    hold.notify_all()
            if records:
                self.metrics.leases_expired.labels("lease").inc(len(records))
            if reserved:
                self.metrics.leases_expired.labels("reservation").inc(len(reserved))
            if len(records) < EXPIRE_BATCH and len(reserved) < EXPIRE_BATCH:
                return

    def _expire_retention(self) -> None:
        """Apply retention deadlines that passed, in every tier (else read only when a
        victim is chosen, and a store that evicts nothing would never show expiries), at
        most EXPIRE_BATCH keys per tier and lock hold."""
        policies = [self.index.policy, *(state.policy for state in self.tiers)]
        more = True
        while more:
            with self._locked("expire_retention"):
                for policy in policies:
                    policy.expire(EXPIRE_BATCH)
                more = any(policy.has_due for policy in policies)

    # ------------------------------------------------------------------ housekeeping

    def housekeeping(self) -> None:
        """What the server runs every half second (see :mod:`kvtier.store.housekeeping`)."""
        self.expire()
        self._expire_retention()
        self._housekeeper.run()
        self._set_gauges()

    def _untrusted(self, tier: str, what: str, count: int) -> None:
        self.metrics.untrusted.labels(tier, what).inc(count)

    def _bookings_refused(self, tier: str, limit: str, count: int) -> None:
        self.metrics.bookings_refused.labels(tier, limit).inc(count)

    def _swept(self, tier: str, chunks: int, nbytes: int) -> None:
        self.metrics.evictions.labels(tier, "sweep").inc(chunks)

    def _breaker_changed(self, tier: str, old: BreakerState, new: BreakerState,
                         reason: str) -> None:
        if new is BreakerState.OPEN and old is BreakerState.CLOSED:
            log.warning("tier %s bypassed (circuit breaker open): %s", tier, reason)
        elif new is BreakerState.CLOSED:
            log.info("tier %s back in service (circuit breaker closed): %s", tier, reason)
        else:
            log.debug("tier %s breaker %s -> %s: %s", tier, old.name, new.name, reason)
        self.metrics.breaker_state.labels(tier).set(int(new))
        self.metrics.breaker_transitions.labels(tier, new.name.lower()).inc()

    # ------------------------------------------------------------------ views, shutdown

    def events_since(self, seq: int, limit: int = 4096, namespace: bytes | None = None
                     ) -> tuple[list[Event], int, bool]:
        """Store events after ``seq`` (see :mod:`kvtier.store.events`)."""
        with self._locked("events"):
            return self.events.since(seq, limit, namespace)

    def stats(self) -> dict[str, object]:
        with self._locked("stats"):
            return views.stats(self.index, self.tiers, self.metrics, self.clock(),
                               leases=self.leases, reservations=self.reservations)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until no lower-tier write, delete or promotion is in flight. True if drained."""
        deadline = time.monotonic() + timeout_s
        with self._locked("flush") as hold:
            while (self.writes.in_flight or self.promotions.in_flight
                   or any(state.deleting for state in self.tiers)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                hold.wait(left)
        self._set_gauges()
        return True

    def close(self, drain_s: float = 10.0) -> None:
        """Write back what only the arena holds, finish writes in flight (up to
        ``drain_s``), stop the I/O threads, free the arena."""
        if drain_s > 0:
            with self._locked("close"):
                self.writes.back_all()
        self.flush(drain_s)
        with self._locked("close") as hold:
            self._closed = True
            hold.notify_all()
        for sharing in self.sharing.values():
            sharing.close()
        for state in self.tiers:
            state.close(wait_s=0)
        self.index.arena.close()
        self.index.arena.unlink()

    def check_integrity(self) -> None:
        """Raise IntegrityError if the arena, the entries, the leases and the tiers disagree."""
        with self._locked("check_integrity"):
            self.quotas.check_integrity()
            check_store(self.index, self.leases, self.reservations, self.tiers, self.writes,
                        self.promotions)

    def _set_gauges(self) -> None:
        views.set_gauges(self.index, self.tiers, self.metrics, self.clock(), self.lock_max_s)


def _retention(priority: int, retain_s: float | None) -> Retention:
    """A request's retention, or InvalidRequest naming the bad value and what is allowed."""
    try:
        return Retention(check_priority(priority), check_duration(retain_s))
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def _lasting(retention: tuple[int, float | None]) -> tuple[int, float]:
    """Order of retentions for one chunk held in several tiers: the higher priority, then
    the later deadline (none is latest)."""
    priority, until = retention
    return priority, float("inf") if until is None else until
