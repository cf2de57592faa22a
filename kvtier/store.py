"""The tiered store: what is cached where, kept correct, moved between tiers.

One arena (host RAM, shared with engine processes) on top, then the lower tiers in config
order. Every lower-tier hit is staged through the arena. The operations clients see:

- ``lookup(keys)``: tiers of the longest prefix of ``keys`` available now. No side effects.
- ``reserve`` -> client writes payloads into the slots -> ``commit`` (or ``abort``): the
  two-phase store. Commit makes chunks servable and starts write-through copies below.
- ``lease`` -> (``wait`` while lower-tier chunks are promoted) -> client reads -> ``release``:
  the two-phase load. A leased or in-flight slot is never evicted or reused.
- ``expire``/``drop_owner``: leases and reservations die with their client or after the TTL.

Admission rules of lower tiers see one use per chunk per request: a leased hit or an offer
to ``reserve`` (granted or not).

All bookkeeping happens under one lock; payload I/O runs on each tier's thread pool and
reports back through ``_write_done``/``_promote_done``. Expected outcomes (a miss, no room,
a refused admission) are return values; ``check_integrity()`` raises IntegrityError when
the books disagree.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from kvtier.codec import HEADER_SIZE, seal, stored_size, verify
from kvtier.config import ServerConfig
from kvtier.entry import Entry, ItemState, LeaseItem, LeaseRecord, Where
from kvtier.errors import ConfigError, CorruptChunkError, IntegrityError, TierError
from kvtier.keys import ChunkKey
from kvtier.lower import TierState
from kvtier.metrics import StoreMetrics
from kvtier.policies import DEFAULT_PRIORITY, EvictionPolicy, check_priority, make_eviction
from kvtier.tiers.arena import Arena

log = logging.getLogger("kvtier.store")
ARENA = "arena"


class TieredStore:
    def __init__(self, config: ServerConfig, *, arena_name: str,
                 metrics: StoreMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics or StoreMetrics()
        self.clock = clock
        ac = config.arena
        self.arena = Arena(arena_name, ac.num_slots, ac.slot_bytes, prefault=ac.prefault)
        self.policy: EvictionPolicy[Hashable] = make_eviction(ac.eviction, ac.num_slots)
        self.tiers = [self._tier(i, ac.slot_bytes) for i in range(len(config.tiers))]
        self.tiers_by_name = {state.name: state for state in self.tiers}
        self.entries: dict[ChunkKey, Entry] = {}
        self.leases: dict[int, LeaseRecord] = {}
        self._lease_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Free slots ahead of need only pays when freeing means a write (write-back);
        # clean chunks are evicted on demand at no cost.
        write_back = any(t.write_back for t in self.tiers)
        self._free_target = int(ac.free_target * ac.num_slots) if write_back else 0
        self._demoting = 0
        self._closed = False
        self._set_gauges()

    # ------------------------------------------------------------------ startup

    def _tier(self, index: int, chunk_bytes: int) -> TierState:
        try:
            return TierState(self.config.tiers[index], chunk_bytes)
        except ConfigError as exc:
            raise ConfigError(f"tiers[{index}]: {exc}") from exc

    def rebuild(self) -> int:
        """Index what the lower tiers already hold (after a restart). Returns chunk count."""
        count = 0
        for state in self.tiers:
            found = sorted(state.tier.scan(), key=lambda c: c.mtime, reverse=True)
            room, kept = state.capacity - state.used, []
            for chunk in found:  # the newest fill the tier; if it shrank, the oldest go
                if chunk.size > room:
                    state.deleting.add(chunk.key)
                    state.executor.submit(self._delete_job, state, chunk.key)
                    continue
                room -= chunk.size
                kept.append(chunk)
            with self._lock:
                for chunk in reversed(kept):  # oldest first, as the eviction policy orders
                    state.added(chunk.key, chunk.size, 0, chunk.priority)
                    entry = self.entries.setdefault(chunk.key, Entry(chunk.key, chunk.priority))
                    entry.lower.add(state.name)
                    count += 1
            log.info("tier %s: indexed %d chunks, %d bytes", state.name, len(state.sizes),
                     state.used)
        self._set_gauges()
        return count

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[ChunkKey]) -> list[str]:
        """The tier holding each chunk of the longest prefix of ``keys`` available now."""
        with self._lock:
            tiers: list[str] = []
            for key in keys:
                tier = self._tier_of(self.entries.get(key))
                if tier is None:
                    break
                tiers.append(tier)
        self.metrics.lookup_chunks.labels("hit").inc(len(tiers))
        self.metrics.lookup_chunks.labels("miss").inc(len(keys) - len(tiers))
        return tiers

    def _tier_of(self, entry: Entry | None) -> str | None:
        if entry is None:
            return None
        if entry.where is Where.READY:
            return ARENA
        for state in self.tiers:
            if state.name in entry.lower:
                return state.name
        return None

    # ------------------------------------------------------------------ store

    def reserve(self, owner: int, namespace_fp: bytes, keys: Sequence[ChunkKey], *,
                payload_len: int, tokens: int, priority: int = DEFAULT_PRIORITY,
                first_index: int = 0) -> list[int | None]:
        """A slot for each key to write its payload into; ``None`` means skip that chunk.

        Raises ValueError when the payload cannot fit a slot or the priority is invalid.
        """
        check_priority(priority)
        if payload_len <= 0 or stored_size(payload_len) > self.arena.slot_bytes:
            raise ValueError(
                f"payload_len {payload_len} does not fit an arena slot of "
                f"{self.arena.slot_bytes} bytes (at most "
                f"{self.arena.slot_bytes - HEADER_SIZE} payload bytes)"
            )
        deadline = self.clock() + self.config.lease_ttl_s
        slots: list[int | None] = []
        with self._lock:
            for i, key in enumerate(keys):
                self._record_use(key)
                entry = self.entries.get(key)
                if entry is not None and entry.where is not Where.ABSENT:
                    if entry.where is Where.READY:
                        self.policy.touch(key)
                        self._write_through(entry)
                    self.metrics.store_refusals.labels("present").inc()
                    slots.append(None)
                    continue
                slot = self._alloc_slot()
                if slot is None:
                    self.metrics.store_refusals.labels("arena_full").inc()
                    slots.append(None)
                    continue
                entry = entry or self.entries.setdefault(key, Entry(key, priority))
                entry.priority = max(entry.priority, priority) if entry.lower else priority
                entry.where, entry.slot, entry.owner, entry.deadline = (
                    Where.RESERVED, slot, owner, deadline)
                entry.namespace_fp, entry.tokens, entry.payload_len = (
                    namespace_fp, tokens, payload_len)
                entry.prefix_tokens, entry.sealed = (first_index + i + 1) * tokens, False
                slots.append(slot)
        return slots

    def commit(self, keys: Sequence[ChunkKey]) -> int:
        """Publish reserved chunks; returns how many were committed.

        Chunks are inserted tail first, so the head of a prefix is the most recently used.
        """
        count = 0
        with self._lock:
            for key in reversed(keys):
                entry = self.entries.get(key)
                if entry is None or entry.where is not Where.RESERVED:
                    continue
                assert entry.slot is not None
                self.arena.publish(entry.slot)
                entry.where, entry.owner = Where.READY, None
                self.policy.insert(key, entry.priority)
                self._write_through(entry)
                count += 1
            self._maintain_free()
            self._changed.notify_all()
        self._set_gauges()
        return count

    def abort(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            count = sum(self._abort_one(key) for key in keys)
            self._changed.notify_all()
        return count

    def _abort_one(self, key: ChunkKey) -> bool:
        entry = self.entries.get(key)
        if entry is None or entry.where is not Where.RESERVED:
            return False
        self._drop_slot(entry)
        return True

    def _write_through(self, entry: Entry) -> None:
        targets = [s for s in self.tiers if not s.write_back and self._wants(s, entry)]
        if targets:
            self._submit_write(entry, targets)

    def _wants(self, state: TierState, entry: Entry) -> bool:
        if entry.key in state or entry.key in state.deleting or state.name in entry.writing:
            return False  # held, or its delete is queued: a write racing it could be lost
        if not state.admits(entry.key, entry.priority, entry.prefix_tokens):
            self.metrics.admission_refusals.labels(state.name, "policy").inc()
            return False
        return True

    def _record_use(self, key: ChunkKey) -> None:
        for state in self.tiers:
            state.record_use(key)

    # ------------------------------------------------------------------ arena space

    def _alloc_slot(self) -> int | None:
        slot = self.arena.alloc()
        while slot is None:
            victims = self.policy.evict(1, self._pinned)
            if not victims:
                return None
            if not self._evict_from_arena(ChunkKey(victims[0])):  # type: ignore[arg-type]
                return None  # written back first: one victim per slot, not the whole arena
            slot = self.arena.alloc()
        return slot

    def _pinned(self, key: Hashable) -> bool:
        entry = self.entries[ChunkKey(key)]  # type: ignore[arg-type]
        assert entry.slot is not None
        return (bool(self.arena.leases[entry.slot]) or bool(entry.writing)
                or entry.where is Where.PROMOTING)

    def _evict_from_arena(self, key: ChunkKey) -> bool:
        """``key`` left the arena policy: write it back below if wanted, else free it.

        Returns whether its slot is free now (a write-back frees it when the write is done).
        """
        entry = self.entries[key]
        self.metrics.evictions.labels(ARENA, "capacity").inc()
        targets = [s for s in self.tiers if s.write_back and self._wants(s, entry)]
        if targets:
            self._demoting += 1
            self._submit_write(entry, targets, evicting=True)
        else:
            self._drop_slot(entry)
        return entry.slot is None

    def _maintain_free(self) -> None:
        """Keep ``free_target`` slots free or on their way to free (write-back ahead)."""
        while self.arena.free_slots + self._demoting < self._free_target:
            victims = self.policy.evict(1, self._pinned)
            if not victims:
                return
            self._evict_from_arena(ChunkKey(victims[0]))  # type: ignore[arg-type]

    def _drop_slot(self, entry: Entry) -> None:
        if entry.slot is not None:
            self.arena.free(entry.slot)
        entry.where, entry.slot, entry.owner = Where.ABSENT, None, None
        if not entry.lower and not entry.writing:
            del self.entries[entry.key]

    # ------------------------------------------------------------------ lower-tier writes

    def _submit_write(self, entry: Entry, targets: list[TierState], evicting: bool = False
                      ) -> None:
        size = stored_size(entry.payload_len)
        chosen: list[TierState] = []
        for state in targets:
            victims = state.make_room(size, self._reading_from(state))
            if victims is None:
                self.metrics.admission_refusals.labels(state.name, "full").inc()
                continue
            for victim in victims:
                self._lower_evicted(state, victim)
            entry.writing.add(state.name)
            chosen.append(state)
        if not chosen:
            if evicting:
                self._demoting -= 1
                self._drop_slot(entry)
            return
        assert entry.slot is not None
        chosen[0].executor.submit(self._write_job, entry, entry.slot, chosen, size, evicting)

    def _reading_from(self, state: TierState) -> Callable[[Hashable], bool]:
        def protected(key: Hashable) -> bool:
            entry = self.entries.get(ChunkKey(key))  # type: ignore[arg-type]
            return entry is not None and entry.reading == state.name
        return protected

    def _lower_evicted(self, state: TierState, key: ChunkKey) -> None:
        self.metrics.evictions.labels(state.name, "capacity").inc()
        entry = self.entries.get(key)
        if entry is not None:
            entry.lower.discard(state.name)
            if entry.where is Where.ABSENT and not entry.lower and not entry.writing:
                del self.entries[key]
        state.deleting.add(key)
        state.executor.submit(self._delete_job, state, key)

    def _write_job(self, entry: Entry, slot: int, targets: list[TierState], size: int,
                   evicting: bool) -> None:
        view = self.arena.slot(slot)
        if not entry.sealed:
            seal(view, entry.namespace_fp, entry.key, entry.tokens, entry.payload_len,
                 entry.priority)
            entry.sealed = True
        data = view[:size]
        for i, state in enumerate(targets):
            start = time.perf_counter()
            ok = False
            try:
                written = state.tier.write(entry.key, data)
                ok = True
            except TierError as exc:
                log.warning("write to %s failed: %s", state.name, exc)
                self.metrics.io_errors.labels(state.name, "write").inc()
            elapsed = time.perf_counter() - start
            with self._lock:
                self._write_done(entry, state, size, written if ok else None, elapsed)
                if evicting and i == len(targets) - 1:
                    # Same critical section: nobody sees it READY, written and untracked.
                    self._demoted(entry)
        view.release()

    def _write_done(self, entry: Entry, state: TierState, promised: int, written: int | None,
                    elapsed: float) -> None:
        entry.writing.discard(state.name)
        if written is None:
            state.reserved -= promised
        else:
            state.added(entry.key, written, promised, entry.priority)
            entry.lower.add(state.name)
            self.metrics.bytes.labels(state.name, "write").inc(written)
            self.metrics.io_seconds.labels(state.name, "write").observe(elapsed)
        self._changed.notify_all()

    def _demoted(self, entry: Entry) -> None:
        self._demoting -= 1
        assert entry.slot is not None
        if self.arena.leases[entry.slot] or entry.writing:
            # hot again while it was written, or a copy to another tier still reads the slot
            self.policy.insert(entry.key, entry.priority)
        else:
            self._drop_slot(entry)
        self._changed.notify_all()

    def _delete_job(self, state: TierState, key: ChunkKey) -> None:
        try:
            state.tier.delete(key)
        except TierError as exc:
            log.warning("delete from %s failed: %s", state.name, exc)
            self.metrics.io_errors.labels(state.name, "delete").inc()
        finally:
            with self._lock:
                state.deleting.discard(key)
                self._changed.notify_all()

    # ------------------------------------------------------------------ load

    def lease(self, owner: int, keys: Sequence[ChunkKey]) -> LeaseRecord:
        """Lease the longest available prefix of ``keys``; promote lower-tier chunks.

        In this order, so that the same requests always leave the same state::

            1 pin        arena chunks of the prefix are leased (cannot be evicted)
            2 slots      lower-tier chunks get slots head first; eviction never takes a
                         chunk of this prefix; no slot -> the lease ends before that chunk
            3 uses       every leased chunk is one use for admission below
            4 recency    tail first: arena chunks touched, promoted chunks inserted, so the
                         head of a prefix is the most recent (a prefix is useful from its head)
            5 I/O        promotions are read in the background; ``wait`` reports them
        """
        with self._lock:
            prefix = self._available_prefix(keys)
            pinned: dict[ChunkKey, LeaseItem] = {}
            for entry in prefix:
                if entry.where is Where.READY:
                    assert entry.slot is not None
                    self.arena.lease(entry.slot)
                    pinned[entry.key] = LeaseItem(entry.key, entry.slot, ARENA, ItemState.READY)
            items, started = self._lease_items(prefix, pinned)
            for item in items:  # a chunk cut off the lease is offered to reserve instead
                self._record_use(item.key)
            for item in reversed(items):
                self._touch_leased(self.entries[item.key], item)
            for entry, state in started:
                assert entry.slot is not None
                state.executor.submit(self._promote_job, entry, state, entry.slot)
            record = LeaseRecord(next(self._lease_ids), owner,
                                 self.clock() + self.config.lease_ttl_s, items)
            self.leases[record.lease_id] = record
            self.metrics.leases_active.set(len(self.leases))
        for item in items:
            self.metrics.hits.labels(item.tier).inc()
        return record

    def _available_prefix(self, keys: Sequence[ChunkKey]) -> list[Entry]:
        prefix: list[Entry] = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or not (entry.where in (Where.READY, Where.PROMOTING)
                                     or (entry.where is Where.ABSENT and entry.lower)):
                break
            prefix.append(entry)
        return prefix

    def _lease_items(self, prefix: list[Entry], pinned: dict[ChunkKey, LeaseItem]
                     ) -> tuple[list[LeaseItem], list[tuple[Entry, TierState]]]:
        """Items for the prefix, head first, with slots for the promotions they need."""
        items: list[LeaseItem] = []
        started: list[tuple[Entry, TierState]] = []
        for entry in prefix:
            item = pinned.get(entry.key)
            if item is None:
                item = self._start_promotion(entry, started)
            if item is None:
                for rest in prefix[len(items):]:  # the prefix ends here: unpin the tail
                    tail = pinned.get(rest.key)
                    if tail is not None:
                        self.arena.unlease(tail.slot)
                break
            items.append(item)
        return items, started

    def _start_promotion(self, entry: Entry, started: list[tuple[Entry, TierState]]
                         ) -> LeaseItem | None:
        if entry.where is Where.PROMOTING:  # another lease is already reading it in
            assert entry.slot is not None and entry.reading is not None
            return LeaseItem(entry.key, entry.slot, entry.reading, ItemState.PENDING)
        state = next((s for s in self.tiers if s.name in entry.lower), None)
        if state is None:
            return None
        slot = self._alloc_slot()
        if slot is None:
            self.metrics.store_refusals.labels("arena_full_promote").inc()
            return None
        entry.where, entry.slot, entry.reading = Where.PROMOTING, slot, state.name
        started.append((entry, state))
        return LeaseItem(entry.key, slot, state.name, ItemState.PENDING)

    def _touch_leased(self, entry: Entry, item: LeaseItem) -> None:
        if item.tier == ARENA:
            self.policy.touch(entry.key)
            self._write_through(entry)
        elif entry.key in self.policy:
            self.policy.touch(entry.key)  # joined a promotion already under way
        else:
            self.tiers_by_name[item.tier].policy.touch(entry.key)
            self.policy.insert(entry.key, entry.priority)

    def _promote_job(self, entry: Entry, state: TierState, slot: int) -> None:
        view = self.arena.slot(slot)
        start = time.perf_counter()
        header = None
        try:
            n = state.tier.read_into(entry.key, view)
            if n is not None:
                header = verify(view[:n], entry.key)
        except CorruptChunkError as exc:
            log.warning("chunk %s on %s is corrupt (%s): quarantined", entry.key.hex()[:16],
                        state.name, exc)
            self.metrics.checksum_failures.labels(state.name).inc()
            self._quarantine(state, entry.key)
        except TierError as exc:
            log.warning("read from %s failed: %s", state.name, exc)
            self.metrics.io_errors.labels(state.name, "read").inc()
        finally:
            view.release()
        elapsed = time.perf_counter() - start
        with self._lock:
            if header is not None:
                entry.namespace_fp, entry.tokens = header.namespace_fp, header.tokens
                entry.payload_len, entry.sealed = header.payload_len, True
                self.metrics.bytes.labels(state.name, "read").inc(stored_size(header.payload_len))
                self.metrics.io_seconds.labels(state.name, "read").observe(elapsed)
            self._promote_done(entry, state, ok=header is not None)

    def _quarantine(self, state: TierState, key: ChunkKey) -> None:
        try:
            state.tier.quarantine(key)
        except TierError as exc:
            log.warning("quarantine on %s failed: %s", state.name, exc)

    def _promote_done(self, entry: Entry, state: TierState, ok: bool) -> None:
        assert entry.slot is not None
        entry.reading = None
        waiting = [item for lease in self.leases.values() for item in lease.items
                   if item.key == entry.key and item.state is ItemState.PENDING]
        if ok:
            self.arena.publish(entry.slot)
            entry.where = Where.READY  # already in the arena policy since its lease
            for item in waiting:
                self.arena.lease(entry.slot)
                item.state = ItemState.READY
        else:
            self.policy.remove(entry.key)
            state.forget(entry.key)
            entry.lower.discard(state.name)
            for item in waiting:
                item.state = ItemState.FAILED
            self._drop_slot(entry)
        self._changed.notify_all()

    def wait(self, lease_id: int, timeout_s: float) -> LeaseRecord:
        """Block until the lease has no pending chunk or the timeout passes.

        Waiting renews the lease: a client that asks is alive."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            record = self._lease(lease_id)
            record.deadline = self.clock() + self.config.lease_ttl_s  # its client is alive
            while not record.done and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or lease_id not in self.leases:
                    break
                self._changed.wait(left)
            return record

    def release(self, lease_id: int) -> None:
        with self._lock:
            record = self.leases.pop(self._lease(lease_id).lease_id)
            self._release(record)

    def _lease(self, lease_id: int) -> LeaseRecord:
        record = self.leases.get(lease_id)
        if record is None:
            raise KeyError(f"no open lease {lease_id} (released, expired or never granted)")
        return record

    def _release(self, record: LeaseRecord) -> None:
        for item in record.items:
            if item.state is ItemState.READY:
                self.arena.unlease(item.slot)
            item.state = ItemState.FAILED
        self.metrics.leases_active.set(len(self.leases))
        self._changed.notify_all()

    # ------------------------------------------------------------------ housekeeping

    def set_priority(self, keys: Sequence[ChunkKey], priority: int) -> None:
        check_priority(priority)
        with self._lock:
            for key in keys:
                entry = self.entries.get(key)
                if entry is None:
                    continue
                entry.priority = priority
                self.policy.set_priority(key, priority)
                for state in self.tiers:
                    state.policy.set_priority(key, priority)

    def drop_owner(self, owner: int) -> None:
        """A client went away: release its leases and abort its reservations."""
        with self._lock:
            self._drop_where(lambda lease: lease.owner == owner,
                             lambda entry: entry.owner == owner)

    def expire(self, now: float | None = None) -> None:
        """Drop leases and reservations past their deadline (called periodically)."""
        now = self.clock() if now is None else now
        with self._lock:
            self._drop_where(lambda lease: lease.deadline <= now,
                             lambda entry: entry.deadline <= now)

    def _drop_where(self, lease_dead: Callable[[LeaseRecord], bool],
                    entry_dead: Callable[[Entry], bool]) -> None:
        for record in [r for r in self.leases.values() if lease_dead(r)]:
            del self.leases[record.lease_id]
            self._release(record)
            self.metrics.leases_expired.labels("lease").inc()
        dead = [e for e in self.entries.values()
                if e.where is Where.RESERVED and entry_dead(e)]
        for entry in dead:
            self._drop_slot(entry)
            self.metrics.leases_expired.labels("reservation").inc()
        if dead:
            self._changed.notify_all()

    def renew(self, lease_id: int) -> None:
        with self._lock:
            self._lease(lease_id).deadline = self.clock() + self.config.lease_ttl_s

    def stats(self) -> dict[str, object]:
        with self._lock:
            tiers: dict[str, object] = {
                ARENA: {"slots": self.arena.num_slots, "free": self.arena.free_slots,
                        "ready": len(self.policy), "slot_bytes": self.arena.slot_bytes},
            }
            for s in self.tiers:
                tiers[s.name] = {"chunks": len(s.sizes), "used_bytes": s.used,
                                 "capacity_bytes": s.capacity, **s.tier.describe()}
            return {"tiers": tiers, "leases": len(self.leases), "entries": len(self.entries)}

    def _set_gauges(self) -> None:
        m, a = self.metrics, self.arena
        m.used_bytes.labels(ARENA).set((a.num_slots - a.free_slots) * a.slot_bytes)
        m.capacity_bytes.labels(ARENA).set(a.num_slots * a.slot_bytes)
        m.chunks.labels(ARENA).set(len(self.policy))
        for s in self.tiers:
            m.used_bytes.labels(s.name).set(s.used)
            m.capacity_bytes.labels(s.name).set(s.capacity)
            m.chunks.labels(s.name).set(len(s.sizes))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until no lower-tier write, delete or promotion is in flight. True if drained."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (any(e.writing or e.reading for e in self.entries.values())
                   or any(state.deleting for state in self.tiers)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        self._set_gauges()
        return True

    def close(self, drain_s: float = 10.0) -> None:
        """Write back what only the arena holds, finish writes in flight (up to
        ``drain_s``), stop the I/O threads, free the arena."""
        if drain_s > 0:
            self._write_back_all()
        self.flush(drain_s)
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        for state in self.tiers:
            state.close()
        self.arena.close()
        self.arena.unlink()

    def _write_back_all(self) -> None:
        with self._lock:
            for entry in list(self.entries.values()):
                if entry.where is not Where.READY:
                    continue
                targets = [t for t in self.tiers if t.write_back and self._wants(t, entry)]
                if targets:
                    self._submit_write(entry, targets)

    def check_integrity(self) -> None:
        """Raise IntegrityError if the arena, the entries, the leases and the tiers disagree."""
        with self._lock:
            self.arena.check_integrity()
            for state in self.tiers:
                state.check_integrity()
            self._check_entries()

    def _check_entries(self) -> None:
        slots: dict[int, ChunkKey] = {}
        for key, e in self.entries.items():
            if (e.where is Where.ABSENT) != (e.slot is None):
                raise IntegrityError(f"entry {key.hex()[:16]} is {e.where} with slot {e.slot}")
            if e.slot is not None:
                if e.slot in slots:
                    raise IntegrityError(f"slot {e.slot} belongs to two chunks")
                slots[e.slot] = key
            in_arena = e.where in (Where.READY, Where.PROMOTING)
            if in_arena != (key in self.policy) and not self._in_demotion(e):
                raise IntegrityError(f"entry {key.hex()[:16]} and arena policy disagree")
            for state in self.tiers:
                if (state.name in e.lower) != (key in state):
                    raise IntegrityError(f"entry {key.hex()[:16]} and tier {state.name} disagree")
            if not (e.where is not Where.ABSENT or e.lower or e.writing):
                raise IntegrityError(f"entry {key.hex()[:16]} is stored nowhere")
        busy = self.arena.num_slots - self.arena.free_slots
        if busy != len(slots):
            raise IntegrityError(f"{busy} slots in use but {len(slots)} owned by chunks")
        leased: dict[int, int] = {}
        for record in self.leases.values():
            for item in record.items:
                if item.state is ItemState.READY:
                    leased[item.slot] = leased.get(item.slot, 0) + 1
        for slot in range(self.arena.num_slots):
            if int(self.arena.leases[slot]) != leased.get(slot, 0):
                raise IntegrityError(f"slot {slot}: lease count disagrees with open leases")

    def _in_demotion(self, entry: Entry) -> bool:
        return entry.where is Where.READY and bool(entry.writing)
