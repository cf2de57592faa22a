"""What a trace says before a tier is bought: the four questions, and the sizes they imply.

1. What is shared?          blocks in two or more requests; the hottest shared prefix; the
                            infinite-cache token hit ratio (what no tier size can beat).
2. How soon is it reused?   reuse time, and the stack distance of each reuse (distinct tokens
                            used since) against the device KV budget and device + arena: an
                            LRU cache of C tokens keeps a reuse whose distance is below C.
3. How big against the transfer budget?  KV bytes each request would load, the milliseconds
                            that takes at ``transfer_gbps``, and the peak second's share of it.
4. What never comes back?   blocks used by one request only: pure write cost for a lower
                            tier, the case for an admission rule.

Then :func:`kvtier.trace.recommend.recommend` replays the trace to find the smallest host tier
reaching ``target_share`` of the achievable hit ratio, the disk tier it needs under the arena
that fits, and the admission rule that saves the most disk writes for at most
``max_hit_loss`` of hit ratio. The simulated host tier stands for device + arena together:
kvtier stores every computed chunk in the arena, so the device cache holds a subset of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.trace.analyze import Analysis, analyze
from kvtier.trace.formats import Trace
from kvtier.trace.recommend import Recommendation, recommend
from kvtier.trace.simulate import HOST, TierSpec


@dataclass(frozen=True)
class Reach:
    within_device: float
    """Share of reuses whose stack distance is below the device KV budget."""
    within_arena: float
    """... below device + arena."""


@dataclass(frozen=True)
class TraceAdvice:
    analysis: Analysis
    reach: Reach | None
    recommendation: Recommendation
    arena_tokens: int
    """Recommended arena, never more than fits."""
    disk_tokens: int
    """Recommended disk tier (0: none needed)."""
    admission: tuple[tuple[str, int], ...]


def reach(distances_tokens: np.ndarray, device_tokens: int, arena_tokens: int) -> Reach | None:
    if not len(distances_tokens):
        return None
    n = len(distances_tokens)
    return Reach(float(np.count_nonzero(distances_tokens < device_tokens)) / n,
                 float(np.count_nonzero(distances_tokens < device_tokens + arena_tokens)) / n)


def advise(trace: Trace, bytes_per_token: int, device_tokens: int, arena_fit_tokens: int,
           disk_fit_tokens: int, transfer_gbps: float, target_share: float = 0.9,
           max_hit_loss: float = 0.01) -> TraceAdvice:
    analysis, dist = analyze(trace, bytes_per_token, transfer_gbps=transfer_gbps)
    bt = trace.block_tokens
    specs = [TierSpec(HOST, arena_fit_tokens // bt)]
    if disk_fit_tokens >= bt:
        specs.append(TierSpec("disk", disk_fit_tokens // bt))
    rec = recommend(trace, specs, target_share, max_hit_loss)
    arena = arena_fit_tokens if rec.host is None else min(arena_fit_tokens, rec.host.chunks * bt)
    disk = 0
    if len(specs) > 1:  # no lower size reaches the target: as much as fits
        disk = disk_fit_tokens if rec.lower is None else min(disk_fit_tokens,
                                                             rec.lower.chunks * bt)
    admission = rec.admission.rules if rec.admission is not None and disk else ()
    return TraceAdvice(analysis, reach(dist.stack_distance_tokens, device_tokens, arena), rec,
                       arena, disk, admission)
