"""The two-phase load: lease a prefix, promote what lies below, wait, release.

Orchestrates the store's components for a client that reads: the arena index pins slots, the
lease table records who holds what, promotions read lower-tier chunks into slots, and a leased
arena chunk counts as a use (recency, write-through). Every change is made by the component
that owns the state, under the store's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.keys import ChunkKey
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.store.checks import check_keys
from kvtier.store.lower import LowerTierState
from kvtier.store.records import Entry, ItemState, LeaseItem, LeaseRecord, Where

if TYPE_CHECKING:
    from kvtier.store.core import TieredStore

ARENA = "arena"


class Loads:
    def __init__(self, store: TieredStore) -> None:
        self.store = store

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
        check_keys(keys)
        deadline = self.store.clock() + self.store.config.lease_ttl_s
        with self.store._locked("lease"):
            prefix: list[tuple[ChunkKey, str]] = []
            for key in keys:
                tier = self.store._servable(key)
                if tier is None:
                    break
                prefix.append((key, tier))
            pinned = self._pin_arena_chunks(prefix)
            items, started = self._lease_items(prefix, pinned)
            for item in items:  # a chunk cut off the lease is offered to reserve instead
                self.store._record_use(item.key)
            for item, (_key, tier) in zip(reversed(items), reversed(prefix[:len(items)]),
                                          strict=True):
                self._touch_leased(self.store.index.entries[item.key], item, tier)
            record = self.store.leases.open(owner, items, deadline)
            for entry, state in started:
                self.store.promotions.start(entry, state)
            self.store.metrics.leases_active.set(len(self.store.leases))
        for item in items:
            self.store.metrics.hits.labels(item.tier).inc()
        return record

    def _pin_arena_chunks(self, prefix: list[tuple[ChunkKey, str]]) -> dict[ChunkKey, LeaseItem]:
        pinned: dict[ChunkKey, LeaseItem] = {}
        for key, tier in prefix:
            if tier == ARENA:
                entry = self.store.index.entries[key]
                self.store.index.pin(entry)
                pinned[key] = LeaseItem(key, entry.slot, ARENA, ItemState.READY)
        return pinned

    def _lease_items(self, prefix: list[tuple[ChunkKey, str]], pinned: dict[ChunkKey, LeaseItem]
                     ) -> tuple[list[LeaseItem], list[tuple[Entry, LowerTierState]]]:
        """Items for the prefix, head first, with slots for the promotions they need."""
        items: list[LeaseItem] = []
        started: list[tuple[Entry, LowerTierState]] = []
        try:
            for key, tier in prefix:
                item = pinned.get(key) or self._promotion_item(key, tier, started)
                if item is None:
                    break
                items.append(item)
        except BaseException:  # undo, so a failure leaves nothing pinned or half-started
            for entry, _state in started:
                self.store.index.drop(entry)
            for item in pinned.values():
                self.store.index.unpin(item.slot)
            raise
        for key, _tier in prefix[len(items):]:  # the prefix ends here: unpin the tail
            tail = pinned.get(key)
            if tail is not None:
                self.store.index.unpin(tail.slot)
        return items, started

    def _promotion_item(self, key: ChunkKey, tier: str,
                        started: list[tuple[Entry, LowerTierState]]) -> LeaseItem | None:
        entry = self.store.index.get(key)
        if entry is not None:  # another lease is already reading it in
            assert entry.reading is not None
            return LeaseItem(key, entry.slot, entry.reading, ItemState.PENDING)
        state = self.store.tiers_by_name[tier]
        priority = state.policy.priority(key)
        entry = self.store._take(key, Where.PROMOTING, DEFAULT_PRIORITY if priority is None
                           else priority)
        if entry is None:
            self.store.metrics.store_refusals.labels("arena_full_promote").inc()
            return None
        started.append((entry, state))
        return self.store.promotions.begin(entry, state)

    def _touch_leased(self, entry: Entry, item: LeaseItem, tier: str) -> None:
        if tier == ARENA:
            self.store.index.touch(entry.key)
            self.store.writes.through(entry)
        elif entry.key in self.store.index.policy:
            self.store.index.touch(entry.key)  # joined a promotion already under way
        else:
            self.store.tiers_by_name[tier].policy.touch(entry.key)
            self.store.index.join_order(entry)

    def wait(self, lease_id: int, timeout_s: float, owner: int | None = None) -> LeaseRecord:
        """Block until the lease has no pending chunk or the timeout passes.

        Waiting renews the lease: a client that asks is alive."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self.store._cond:
            record = self.store.leases.get(lease_id, owner)
            self.store.leases.renew(lease_id, self.store.clock() + self.store.config.lease_ttl_s)
            while not record.done and not self.store._closed and not record.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.store._cond.wait(left)
            return record

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """End a lease of ``owner`` (any, for ``None``); InvalidRequest for another's."""
        with self.store._locked("release"):
            self.store.leases.get(lease_id, owner)
            self._close_lease(lease_id)

    def _close_lease(self, lease_id: int) -> None:
        self.unpin(self.store.leases.close(lease_id))
        self.store.metrics.leases_active.set(len(self.store.leases))

    def unpin(self, record: LeaseRecord) -> None:
        """A closed lease lets go of its slots."""
        for item in record.items:
            if item.state is ItemState.READY:
                self.store.index.unpin(item.slot)
            item.state = ItemState.FAILED
        self.store._cond.notify_all()

    def renew(self, lease_id: int) -> None:
        with self.store._locked("renew"):
            self.store.leases.get(lease_id)
            self.store.leases.renew(lease_id, self.store.clock() + self.store.config.lease_ttl_s)

