"""Read-only views of the store: its stats (for clients and the admin view) and gauges."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.store.core import TieredStore

ARENA = "arena"


def stats(store: TieredStore) -> dict[str, object]:
    """The store's stats (lock held by the caller)."""
    now = store.clock()
    arena = store.index.arena
    tiers: dict[str, object] = {
        ARENA: {"slots": arena.num_slots, "free": arena.free_slots,
                "ready": len(store.index.policy), "slot_bytes": arena.slot_bytes},
    }
    for s in store.tiers:
        tiers[s.name] = {
            "chunks": len(s.sizes), "used_bytes": s.used, "capacity_bytes": s.capacity,
            "configured_capacity_bytes": s.configured,
            "limited_by_filesystem": s.limited_by_filesystem,
            "breaker": s.breaker.state.name.lower(),
            "read_chunk_s": s.reads.chunk_s(now), "io_pending": s.pool.pending,
            "checksum_failures": count(store, "kvtier_checksum_failures_total", tier=s.name),
            **s.tier.describe()}
    return {"tiers": tiers, "leases": len(store.leases),
            "reservations": len(store.reservations), "entries": len(store.index.entries)}


def count(store: TieredStore, name: str, **labels: str) -> int:
    return int(store.metrics.registry.get_sample_value(name, labels) or 0)


def set_gauges(store: TieredStore) -> None:
    m, a = store.metrics, store.index.arena
    m.used_bytes.labels(ARENA).set((a.num_slots - a.free_slots) * a.slot_bytes)
    m.capacity_bytes.labels(ARENA).set(a.num_slots * a.slot_bytes)
    m.chunks.labels(ARENA).set(len(store.index.policy))
    now = store.clock()
    for s in store.tiers:
        m.used_bytes.labels(s.name).set(s.used)
        m.capacity_bytes.labels(s.name).set(s.capacity)
        m.chunks.labels(s.name).set(len(s.sizes))
        m.breaker_state.labels(s.name).set(int(s.breaker.state))
        m.read_estimate.labels(s.name).set(s.reads.chunk_s(now) or 0.0)
    for section, held in store.lock_max_s.items():
        m.lock_hold_max.labels(section).set(held)
