"""Hit ratio against host capacity for each eviction policy, with Belady as the ceiling.

Each point is one full replay through :class:`~kvtier.trace.simulate.Simulator` with the host
resized; lower tiers keep their given sizes. The Belady line is one tier holding the whole
capacity of that point (host plus lower tiers): no policy over the same tiers can beat it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.trace.belady import belady
from kvtier.trace.formats import Trace
from kvtier.trace.hits import HitCounts
from kvtier.trace.results import SimResult
from kvtier.trace.reuse import flatten
from kvtier.trace.simulate import HOST, TierSpec, simulate

BELADY = "belady"


@dataclass(frozen=True)
class SweepPoint:
    policy: str
    host_chunks: int | None
    """The swept host size (None: unbounded)."""
    total_chunks: int | None
    block_hit_ratio: float
    token_hit_ratio: float
    lower_blocks_written: int
    elapsed_s: float


def with_policy(specs: Sequence[TierSpec], policy: str, explicit: frozenset[str]) -> list[TierSpec]:
    """``specs`` with ``policy`` on every tier whose eviction was not chosen by name."""
    return [s if s.name in explicit else dataclasses.replace(s, eviction=policy) for s in specs]


def total_capacity(specs: Sequence[TierSpec]) -> int | None:
    sizes = [s.capacity for s in specs]
    return None if any(c is None for c in sizes) else sum(c for c in sizes if c is not None)


def sweep(
    trace: Trace,
    specs: Sequence[TierSpec],
    host_sizes: Sequence[int | None],
    policies: Sequence[str],
    *,
    explicit: frozenset[str] = frozenset(),
    block_bytes: int | None = None,
    progress: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Every policy at every host size, then Belady at each point's total capacity."""
    points: list[SweepPoint] = []
    for policy in policies:
        for size in host_sizes:
            resized = [dataclasses.replace(specs[0], capacity=size), *specs[1:]]
            tiers = with_policy(resized, policy, explicit)
            result = simulate(trace.requests, tiers, trace.block_tokens, block_bytes)
            points.append(_point(policy, size, tiers, result))
            if progress:
                progress(points[-1])
    points.extend(_belady_line(trace, specs, host_sizes, progress))
    return points


def _point(policy: str, size: int | None, tiers: list[TierSpec], result: SimResult) -> SweepPoint:
    lower_written = sum(t.blocks_written for t in result.tiers if t.name != HOST)
    return SweepPoint(
        policy=policy,
        host_chunks=size,
        total_chunks=total_capacity(tiers),
        block_hit_ratio=result.block_hit_ratio,
        token_hit_ratio=result.token_hit_ratio,
        lower_blocks_written=lower_written,
        elapsed_s=result.elapsed_s,
    )


def _belady_line(
    trace: Trace,
    specs: Sequence[TierSpec],
    host_sizes: Sequence[int | None],
    progress: Callable[[SweepPoint], None] | None,
) -> list[SweepPoint]:
    accesses = flatten(trace.requests)
    points = []
    for size in host_sizes:
        total = total_capacity([dataclasses.replace(specs[0], capacity=size), *specs[1:]])
        start = time.perf_counter()
        counts: HitCounts = belady(trace.requests, total, accesses)
        elapsed = time.perf_counter() - start
        ratios = (counts.block_hit_ratio, counts.token_hit_ratio)
        points.append(SweepPoint(BELADY, size, total, *ratios, 0, elapsed))
        if progress:
            progress(points[-1])
    return points


def smallest_reaching(points: Sequence[SweepPoint], policy: str, target: float
                      ) -> SweepPoint | None:
    """The smallest swept host size at which ``policy`` reaches ``target`` block hit ratio."""
    reached = [p for p in points if p.policy == policy and p.block_hit_ratio >= target]
    return min(reached, key=_size_key, default=None)


def _size_key(point: SweepPoint) -> float:
    return float("inf") if point.host_chunks is None else float(point.host_chunks)
