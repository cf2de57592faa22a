"""``check_integrity`` of the store: every record agrees with every other."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.entry import Entry, ItemState, Where
from kvtier.errors import IntegrityError
from kvtier.keys import ChunkKey

if TYPE_CHECKING:
    from kvtier.movement import StoreCore

def check_entries(store: StoreCore) -> None:
    """Entries, slots, the arena policy, lower tiers and leases agree (lock held)."""
    slots: dict[int, ChunkKey] = {}
    for key, e in store.entries.items():
        if (e.where is Where.ABSENT) != (e.slot is None):
            raise IntegrityError(f"entry {key.hex()[:16]} is {e.where} with slot {e.slot}")
        if e.slot is not None:
            if e.slot in slots:
                raise IntegrityError(f"slot {e.slot} belongs to two chunks")
            slots[e.slot] = key
        in_arena = e.where in (Where.READY, Where.PROMOTING)
        if in_arena != (key in store.policy) and not _in_demotion(e):
            raise IntegrityError(f"entry {key.hex()[:16]} and arena policy disagree")
        for state in store.tiers:
            if (state.name in e.lower) != (key in state):
                raise IntegrityError(f"entry {key.hex()[:16]} and tier {state.name} disagree")
        if not (e.where is not Where.ABSENT or e.lower or e.writing):
            raise IntegrityError(f"entry {key.hex()[:16]} is stored nowhere")
    busy = store.arena.num_slots - store.arena.free_slots
    if busy != len(slots):
        raise IntegrityError(f"{busy} slots in use but {len(slots)} owned by chunks")
    leased: dict[int, int] = {}
    for record in store.leases.values():
        for item in record.items:
            if item.state is ItemState.READY:
                leased[item.slot] = leased.get(item.slot, 0) + 1
    for slot in range(store.arena.num_slots):
        if int(store.arena.leases[slot]) != leased.get(slot, 0):
            raise IntegrityError(f"slot {slot}: lease count disagrees with open leases")

def _in_demotion(entry: Entry) -> bool:
    return entry.where is Where.READY and bool(entry.writing)
