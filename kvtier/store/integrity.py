"""``check_integrity`` of the store: every component's books, and how they fit together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import IntegrityError
from kvtier.store.records import Where

if TYPE_CHECKING:
    from kvtier.store.core import TieredStore


def check_store(store: TieredStore) -> None:
    """Each component agrees with itself, and they agree with each other (lock held)."""
    store.index.check_integrity()
    store.leases.check_integrity()
    store.reservations.check_integrity("reservations")
    for state in store.tiers:
        state.check_integrity()
    entries = store.index.entries
    reserved = {k for k, e in entries.items() if e.where is Where.RESERVED}
    if reserved != set(store.reservations):
        raise IntegrityError(f"{len(reserved)} chunks are reserved in the arena but "
                             f"{len(store.reservations)} reservations are held")
    pins: dict[int, int] = {}
    for item in store.leases.ready_items():
        pins[item.slot] = pins.get(item.slot, 0) + 1
    arena = store.index.arena
    for slot in range(arena.num_slots):
        if int(arena.leases[slot]) != pins.get(slot, 0):
            raise IntegrityError(f"slot {slot}: lease count disagrees with open leases")
    writing = sum(len(e.writing) for e in entries.values())
    if writing != store.writes.in_flight:
        raise IntegrityError(f"{writing} writes marked on chunks, {store.writes.in_flight} "
                             "in flight")
    promoting = sum(1 for e in entries.values() if e.where is Where.PROMOTING)
    if promoting != store.promotions.in_flight:
        raise IntegrityError(f"{promoting} chunks promoting, {store.promotions.in_flight} "
                             "reads in flight")
    demoting = sum(1 for e in entries.values() if e.demoting)
    if demoting != store.writes.demoting:
        raise IntegrityError(f"{demoting} chunks demoting, {store.writes.demoting} counted")
