"""The store's state, arena space and the movement of chunks between tiers.

:class:`StoreCore` holds every record of a :class:`~kvtier.store.TieredStore` and the moves
that do not depend on a client request: making room in the arena, write-through and
write-back copies to lower tiers, deletes, promotions into the arena and their completion.
Payload I/O runs on each lower tier's thread pool; ``_write_done``/``_promote_done`` apply
the outcome under the store's lock. The public operations are in :mod:`kvtier.store` and
:mod:`kvtier.leasing`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable

from kvtier.codec import seal, stored_size, verify
from kvtier.config import ServerConfig
from kvtier.entry import Entry, ItemState, LeaseRecord, Where
from kvtier.errors import ConfigError, CorruptChunkError, TierError
from kvtier.keys import ChunkKey
from kvtier.lower import TierState
from kvtier.metrics import StoreMetrics
from kvtier.policies import EvictionPolicy, make_eviction
from kvtier.tiers.arena import Arena

log = logging.getLogger("kvtier.store")
ARENA = "arena"


class StoreCore:
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

    def _tier(self, index: int, chunk_bytes: int) -> TierState:
        try:
            return TierState(self.config.tiers[index], chunk_bytes)
        except ConfigError as exc:
            raise ConfigError(f"tiers[{index}]: {exc}") from exc

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
        try:
            sealed = self._seal(entry, view)
            data = view[:size]
            for i, state in enumerate(targets):
                start = time.perf_counter()
                written = self._write_one(state, entry.key, data) if sealed else None
                elapsed = time.perf_counter() - start
                with self._lock:
                    self._write_done(entry, state, size, written, elapsed)
                    if evicting and i == len(targets) - 1:
                        # Same critical section: nobody sees it READY, written and untracked.
                        self._demoted(entry)
        finally:
            view.release()

    def _seal(self, entry: Entry, view: memoryview) -> bool:
        if entry.sealed:
            return True
        try:
            seal(view, entry.namespace_fp, entry.key, entry.tokens, entry.payload_len,
                 entry.priority)
        except Exception:  # a bad field must fail this write, not strand the entry
            log.exception("cannot seal chunk %s", entry.key.hex()[:16])
            return False
        entry.sealed = True
        return True

    def _write_one(self, state: TierState, key: ChunkKey, data: memoryview) -> int | None:
        """Bytes the tier now holds for ``key``, or ``None`` when the write failed."""
        try:
            return state.tier.write(key, data)
        except TierError as exc:
            log.warning("write to %s failed: %s", state.name, exc)
        except Exception:  # an unexpected bug must not leave the entry "writing" forever
            log.exception("write to %s failed", state.name)
        self.metrics.io_errors.labels(state.name, "write").inc()
        return None

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

    def _promote_job(self, entry: Entry, state: TierState, slot: int) -> None:
        view = self.arena.slot(slot)
        start = time.perf_counter()
        header, keep = None, False
        try:
            n = state.tier.read_into(entry.key, view)
            if n is not None:
                header = verify(view[:n], entry.key)
        except CorruptChunkError as exc:
            log.warning("chunk %s on %s is corrupt (%s): quarantined", entry.key.hex()[:16],
                        state.name, exc)
            self.metrics.checksum_failures.labels(state.name).inc()
            self._quarantine(state, entry.key)
        except Exception as exc:  # I/O error (or a bug): this load fails, the copy stays
            log.warning("read from %s failed: %s", state.name, exc)
            self.metrics.io_errors.labels(state.name, "read").inc()
            keep = True
        finally:
            view.release()
        elapsed = time.perf_counter() - start
        with self._lock:
            if header is not None:
                entry.namespace_fp, entry.tokens = header.namespace_fp, header.tokens
                entry.payload_len, entry.sealed = header.payload_len, True
                self.metrics.bytes.labels(state.name, "read").inc(stored_size(header.payload_len))
                self.metrics.io_seconds.labels(state.name, "read").observe(elapsed)
            self._promote_done(entry, state, ok=header is not None, keep_copy=keep)

    def _quarantine(self, state: TierState, key: ChunkKey) -> None:
        try:
            state.tier.quarantine(key)
        except TierError as exc:
            log.warning("quarantine on %s failed: %s", state.name, exc)

    def _promote_done(self, entry: Entry, state: TierState, ok: bool,
                      keep_copy: bool = False) -> None:
        """Publish a promoted chunk, or fail its waiters; a missing or corrupt copy is
        forgotten, one that only failed to read (``keep_copy``) stays indexed."""
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
            if not keep_copy:
                state.forget(entry.key)
                entry.lower.discard(state.name)
            for item in waiting:
                item.state = ItemState.FAILED
            self._drop_slot(entry)
        self._changed.notify_all()

    def _set_gauges(self) -> None:
        m, a = self.metrics, self.arena
        m.used_bytes.labels(ARENA).set((a.num_slots - a.free_slots) * a.slot_bytes)
        m.capacity_bytes.labels(ARENA).set(a.num_slots * a.slot_bytes)
        m.chunks.labels(ARENA).set(len(self.policy))
        for s in self.tiers:
            m.used_bytes.labels(s.name).set(s.used)
            m.capacity_bytes.labels(s.name).set(s.capacity)
            m.chunks.labels(s.name).set(len(s.sizes))
