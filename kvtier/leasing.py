"""The two-phase load: lease a prefix, promote what lies below, wait, release."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.entry import Entry, ItemState, LeaseItem, LeaseRecord, Where
from kvtier.keys import ChunkKey
from kvtier.lower import TierState
from kvtier.movement import ARENA, StoreCore


class Leasing(StoreCore):
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

    def wait(self, lease_id: int, timeout_s: float, owner: int | None = None) -> LeaseRecord:
        """Block until the lease has no pending chunk or the timeout passes.

        Waiting renews the lease: a client that asks is alive."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            record = self._lease(lease_id, owner)
            record.deadline = self.clock() + self.config.lease_ttl_s  # its client is alive
            while not record.done and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or lease_id not in self.leases:
                    break
                self._changed.wait(left)
            return record

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """End a lease of ``owner`` (any, for ``None``); raises KeyError for another's."""
        with self._lock:
            record = self.leases.pop(self._lease(lease_id, owner).lease_id)
            self._release(record)

    def _lease(self, lease_id: int, owner: int | None = None) -> LeaseRecord:
        record = self.leases.get(lease_id)
        if record is None or owner not in (None, record.owner):
            raise KeyError(f"no open lease {lease_id} of this client (released, expired or "
                           "never granted)")
        return record

    def _release(self, record: LeaseRecord) -> None:
        for item in record.items:
            if item.state is ItemState.READY:
                self.arena.unlease(item.slot)
            item.state = ItemState.FAILED
        self.metrics.leases_active.set(len(self.leases))
        self._changed.notify_all()

    def renew(self, lease_id: int) -> None:
        with self._lock:
            self._lease(lease_id).deadline = self.clock() + self.config.lease_ttl_s
