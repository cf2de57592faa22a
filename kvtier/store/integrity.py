"""``check_integrity`` of the store: every component's books, and how they fit together."""

from __future__ import annotations

from kvtier.errors import IntegrityError
from kvtier.keys import ChunkKey
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.holdings import Holdings
from kvtier.store.leases import LeaseTable
from kvtier.store.lower import LowerTierState
from kvtier.store.promotions import Promotions
from kvtier.store.records import Where
from kvtier.store.writes import Writes


def check_store(index: ArenaIndex, leases: LeaseTable, reservations: Holdings[ChunkKey],
                tiers: list[LowerTierState], writes: Writes, promotions: Promotions) -> None:
    """Each component agrees with itself, and they agree with each other (lock held)."""
    index.check_integrity()
    leases.check_integrity()
    reservations.check_integrity("reservations")
    for state in tiers:
        state.check_integrity()
    entries = index.entries
    reserved = {k for k, e in entries.items() if e.where is Where.RESERVED}
    if reserved != set(reservations):
        raise IntegrityError(f"{len(reserved)} chunks are reserved in the arena but "
                             f"{len(reservations)} reservations are held")
    pins: dict[int, int] = {}
    for item in leases.ready_items():
        pins[item.slot] = pins.get(item.slot, 0) + 1
    arena = index.arena
    for slot in range(arena.num_slots):
        if int(arena.leases[slot]) != pins.get(slot, 0):
            raise IntegrityError(f"slot {slot}: lease count disagrees with open leases")
    writing = sum(len(e.writing) for e in entries.values())
    if writing != writes.in_flight:
        raise IntegrityError(f"{writing} writes marked on chunks, {writes.in_flight} "
                             "in flight")
    promoting = sum(1 for e in entries.values() if e.where is Where.PROMOTING)
    if promoting != promotions.in_flight:
        raise IntegrityError(f"{promoting} chunks promoting, {promotions.in_flight} "
                             "reads in flight")
    demoting = sum(1 for e in entries.values() if e.demoting)
    if demoting != writes.demoting:
        raise IntegrityError(f"{demoting} chunks demoting, {writes.demoting} counted")
