"""The two-phase load: lease a prefix, promote what lies below, release.

Orchestrates the store's components for a client that reads: the arena index pins slots, the
lease table records who holds what, promotions read lower-tier chunks into slots, and a leased
arena chunk counts as a use (recency, write-through). Every change is made by the component
that owns the state. Every method here runs under the store lock, which
:class:`~kvtier.store.core.TieredStore` takes (it also decides what is servable, and waits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.keys import ChunkKey
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.leases import LeaseTable
from kvtier.store.lower import LowerTierState
from kvtier.store.placement import record_use
from kvtier.store.promotions import Promotions
from kvtier.store.records import Entry, ItemState, LeaseItem, LeaseRecord, Where
from kvtier.store.writes import Writes

if TYPE_CHECKING:
    from kvtier.metrics import StoreMetrics

ARENA = "arena"


class Loads:
    def __init__(self, index: ArenaIndex, leases: LeaseTable, promotions: Promotions,
                 writes: Writes, tiers: list[LowerTierState], metrics: StoreMetrics) -> None:
        self.index = index
        self.leases = leases
        self.promotions = promotions
        self.writes = writes
        self.tiers = tiers
        self.tiers_by_name = {state.name: state for state in tiers}
        self.metrics = metrics

    def lease(self, owner: int, prefix: list[tuple[ChunkKey, str]], deadline: float
              ) -> LeaseRecord:
        """Lease ``prefix`` (each key with the tier it is servable from, head first);
        promote lower-tier chunks.

        In this order, so that the same requests always leave the same state::

            1 pin        arena chunks of the prefix are leased (cannot be evicted)
            2 slots      lower-tier chunks get slots head first; eviction never takes a
                         chunk of this prefix; no slot -> the lease ends before that chunk
            3 uses       every leased chunk is one use for admission below
            4 recency    tail first: arena chunks touched, promoted chunks inserted, so the
                         head of a prefix is the most recent (a prefix is useful from its head)
            5 I/O        promotions are read in the background; ``wait`` reports them
        """
        pinned = self._pin_arena_chunks(prefix)
        items, started = self._lease_items(prefix, pinned)
        for item in items:  # a chunk cut off the lease is offered to reserve instead
            record_use(self.tiers, item.key)
        for item, (_key, tier) in zip(reversed(items), reversed(prefix[:len(items)]),
                                      strict=True):
            self._touch_leased(self.index.entries[item.key], item, tier)
        record = self.leases.open(owner, items, deadline)
        for entry, state in started:
            self.promotions.start(entry, state)
        self.metrics.leases_active.set(len(self.leases))
        return record

    def _pin_arena_chunks(self, prefix: list[tuple[ChunkKey, str]]) -> dict[ChunkKey, LeaseItem]:
        pinned: dict[ChunkKey, LeaseItem] = {}
        for key, tier in prefix:
            if tier == ARENA:
                entry = self.index.entries[key]
                self.index.pin(entry)
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
                self.index.drop(entry)
            for item in pinned.values():
                self.index.unpin(item.slot)
            raise
        for key, _tier in prefix[len(items):]:  # the prefix ends here: unpin the tail
            tail = pinned.get(key)
            if tail is not None:
                self.index.unpin(tail.slot)
        return items, started

    def _promotion_item(self, key: ChunkKey, tier: str,
                        started: list[tuple[Entry, LowerTierState]]) -> LeaseItem | None:
        entry = self.index.get(key)
        if entry is not None:  # another lease is already reading it in
            assert entry.reading is not None
            return LeaseItem(key, entry.slot, entry.reading, ItemState.PENDING)
        state = self.tiers_by_name[tier]
        size = state.books.sizes.get(key, 0)
        priority, until = self.writes.carried(
            state.name, None, key, size, state.policy.retention(key) or (DEFAULT_PRIORITY, None))
        entry = self.writes.take(key, Where.PROMOTING, priority, until)
        if entry is None:
            self.metrics.store_refusals.labels("arena_full_promote").inc()
            return None
        started.append((entry, state))
        return self.promotions.begin(entry, state)

    def _touch_leased(self, entry: Entry, item: LeaseItem, tier: str) -> None:
        if tier == ARENA:
            self.index.touch(entry.key)
            self.writes.through(entry)
        elif entry.key in self.index.policy:
            self.index.touch(entry.key)  # joined a promotion already under way
        else:
            self.tiers_by_name[tier].touch(entry.key)
            self.index.join_order(entry)

    def release(self, lease_id: int, owner: int | None = None) -> None:
        """End a lease of ``owner`` (any, for ``None``); InvalidRequest for another's."""
        self.leases.get(lease_id, owner)
        self.unpin(self.leases.close(lease_id))
        self.metrics.leases_active.set(len(self.leases))

    def unpin(self, record: LeaseRecord) -> None:
        """A closed lease lets go of its slots (the store wakes its waiters)."""
        for item in record.items:
            if item.state is ItemState.READY:
                self.index.unpin(item.slot)
            item.state = ItemState.FAILED

    def renew(self, lease_id: int, deadline: float) -> None:
        self.leases.get(lease_id)
        self.leases.renew(lease_id, deadline)
