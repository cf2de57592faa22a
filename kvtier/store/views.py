"""Read-only views of the store: its stats (for clients and the admin view) and gauges.

Pure functions of the components they are handed (the caller holds the store lock where
it must).
"""

from __future__ import annotations

from collections.abc import Hashable, Sized
from typing import TYPE_CHECKING

from kvtier.policies import EvictionPolicy
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.lower import LowerTierState

if TYPE_CHECKING:
    from kvtier.metrics import StoreMetrics

ARENA = "arena"


def stats(index: ArenaIndex, tiers: list[LowerTierState], metrics: StoreMetrics, now: float,
          *, leases: Sized, reservations: Sized) -> dict[str, object]:
    """The store's stats (lock held by the caller)."""
    arena = index.arena
    out: dict[str, object] = {
        ARENA: {"slots": arena.num_slots, "free": arena.free_slots,
                "ready": len(index.policy), "slot_bytes": arena.slot_bytes},
    }
    for s in tiers:
        out[s.name] = {
            "chunks": len(s.sizes), "used_bytes": s.used, "capacity_bytes": s.capacity,
            "configured_capacity_bytes": s.configured,
            "limited_by_filesystem": s.limited_by_filesystem,
            "breaker": s.breaker.state.name.lower(),
            "read_chunk_s": s.reads.chunk_s(now), "io_pending": s.pool.pending,
            "checksum_failures": count(metrics, "kvtier_checksum_failures_total", tier=s.name),
            **s.tier.describe()}
    return {"tiers": out, "leases": len(leases),
            "reservations": len(reservations), "entries": len(index.entries)}


def count(metrics: StoreMetrics, name: str, **labels: str) -> int:
    return int(metrics.registry.get_sample_value(name, labels) or 0)


def set_gauges(index: ArenaIndex, tiers: list[LowerTierState], metrics: StoreMetrics,
               now: float, lock_max_s: dict[str, float]) -> None:
    m, a = metrics, index.arena
    m.used_bytes.labels(ARENA).set((a.num_slots - a.free_slots) * a.slot_bytes)
    m.capacity_bytes.labels(ARENA).set(a.num_slots * a.slot_bytes)
    m.chunks.labels(ARENA).set(len(index.policy))
    for s in tiers:
        m.used_bytes.labels(s.name).set(s.used)
        m.capacity_bytes.labels(s.name).set(s.capacity)
        m.chunks.labels(s.name).set(len(s.sizes))
        m.breaker_state.labels(s.name).set(int(s.breaker.state))
        m.read_estimate.labels(s.name).set(s.reads.chunk_s(now) or 0.0)
    retention_gauges(m, ARENA, index.policy, a.slot_bytes)
    for s in tiers:
        retention_gauges(m, s.name, s.policy, s.used // max(1, len(s.sizes)))
    for section, held in list(lock_max_s.items()):
        m.lock_hold_max.labels(section).set(held)


BANDS = ((0, 34, "0-34"), (35, 35, "35"), (36, 79, "36-79"), (80, 100, "80-100"))
"""Retention priority bands of the retained-chunk gauges."""


def band_of(priority: int) -> str:
    return next(name for low, high, name in BANDS if low <= priority <= high)


def retention_gauges(m: StoreMetrics, tier: str, policy: EvictionPolicy[Hashable],
                     chunk_bytes: int) -> None:
    """Chunks and bytes per priority band, and the expiries since the last call: O(the
    priorities in use), never a walk over the chunks."""
    chunks = dict.fromkeys((name for _, _, name in BANDS), 0)
    for priority, n in policy.count_by_priority().items():
        chunks[band_of(priority)] += n
    for name, n in chunks.items():
        m.retained_chunks.labels(tier, name).set(n)
        m.retained_bytes.labels(tier, name).set(n * chunk_bytes)
    with m.retention_lock:
        total, seen = policy.expired, m.expiries_seen.get(tier, 0)
        if total > seen:
            m.retention_expiries.labels(tier).inc(total - seen)
            m.expiries_seen[tier] = total
