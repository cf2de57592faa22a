"""What a trace says about sizing tiers: arrivals, lengths, sharing, reuse, KV bytes.

Everything here comes from one pass over the flattened access stream
(:mod:`kvtier.trace.reuse`), exactly, not sampled. Hit ratios of finite tiers are not among
them: the store's recency order depends on which blocks hit, so they come from replaying the
trace (``kvtier trace simulate --sweep`` or ``--recommend``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.trace.formats import Trace
from kvtier.trace.reuse import COLD, Accesses, flatten, infinite_hits, previous_use, stack_distances
from kvtier.trace.sharing import Sharing, requests_per_block, sharing
from kvtier.trace.stats import Summary, summarize


@dataclass(frozen=True)
class Arrivals:
    requests: int
    duration_s: float
    rate_per_s: float
    interarrival_cv: float | None
    """Coefficient of variation of the gaps between arrivals: 1 for Poisson, > 1 bursty."""
    peak_to_mean_1s: float | None
    peak_to_mean_60s: float | None


@dataclass(frozen=True)
class Reuse:
    blocks: int
    accesses: int
    never_reused: int
    never_reused_share: float
    """Blocks used by one request only, over all blocks: pure write cost for a lower tier."""
    reuse_time_s: Summary
    first_reuse_s: Summary
    """From a block's first use (its creation) to its second."""
    stack_distance_tokens: Summary
    """Over reuses only: distinct blocks used since the block's previous use, in tokens."""


@dataclass(frozen=True)
class Hits:
    block_hit_ratio: float
    token_hit_ratio: float
    """Infinite cache, prefix rule: what no tier size can beat."""


@dataclass(frozen=True)
class Kv:
    bytes_per_token: int
    block_bytes: int
    footprint_bytes: int
    reused_footprint_bytes: int
    hit_bytes: int
    hit_bytes_per_request: Summary
    mean_hit_bytes_per_s: float
    peak_hit_bytes_per_s: float
    """Over 1 s windows: the load rate an infinite host would have to serve."""
    transfer_gbps: float | None
    load_ms_per_request: Summary | None
    peak_budget_share: float | None


@dataclass(frozen=True)
class Analysis:
    source: str
    format: str
    block_tokens: int
    arrivals: Arrivals
    input_tokens: Summary
    output_tokens: Summary
    sharing: Sharing
    reuse: Reuse
    hits: Hits
    kv: Kv | None


@dataclass(frozen=True)
class Distributions:
    """Raw samples behind the summaries, for plots."""

    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    requests_per_block: np.ndarray
    reuse_time_s: np.ndarray
    first_reuse_s: np.ndarray
    stack_distance_tokens: np.ndarray


def analyze(
    trace: Trace,
    bytes_per_token: int | None = None,
    *,
    top: int = 10,
    transfer_gbps: float | None = None,
) -> tuple[Analysis, Distributions]:
    acc = flatten(trace.requests)
    distances = stack_distances(acc.ids)
    served = infinite_hits(acc)
    bt = trace.block_tokens
    kv = None
    if bytes_per_token is not None:
        kv = _kv(trace, acc, served, bytes_per_token, transfer_gbps)
    analysis = Analysis(
        source=trace.source,
        format=trace.format,
        block_tokens=bt,
        arrivals=_arrivals(trace),
        input_tokens=summarize(np.array([r.input_tokens for r in trace.requests])),
        output_tokens=summarize(np.array([r.output_tokens for r in trace.requests])),
        sharing=sharing(acc, bt, top),
        reuse=_reuse(acc, distances, bt),
        hits=_hits(trace, acc, served),
        kv=kv,
    )
    return analysis, _distributions(trace, acc, distances)


def _arrivals(trace: Trace) -> Arrivals:
    ts = np.sort(np.array([r.ts_s for r in trace.requests]))
    duration = float(ts[-1] - ts[0])
    gaps = np.diff(ts)
    cv = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else None
    rate = (len(ts) - 1) / duration if duration > 0 else 0.0
    return Arrivals(
        len(ts), duration, rate, cv, _peak_to_mean(ts, 1.0), _peak_to_mean(ts, 60.0)
    )


def _peak_to_mean(ts: np.ndarray, window_s: float) -> float | None:
    duration = ts[-1] - ts[0]
    if duration < 2 * window_s:
        return None
    counts = np.bincount(((ts - ts[0]) // window_s).astype(np.int64))
    return float(counts.max() / counts.mean())


def _reuse_times(acc: Accesses) -> tuple[np.ndarray, np.ndarray]:
    """Seconds between consecutive uses of a block; the same for second uses only."""
    prev = previous_use(acc.ids)
    warm = prev >= 0
    second = warm.copy()
    second[warm] = prev[prev[warm]] < 0
    return acc.ts[warm] - acc.ts[prev[warm]], acc.ts[second] - acc.ts[prev[second]]


def _reuse(acc: Accesses, distances: np.ndarray, block_tokens: int) -> Reuse:
    reuse_time, first_reuse = _reuse_times(acc)
    counts = requests_per_block(acc)
    never = int(np.count_nonzero(counts == 1))
    return Reuse(
        blocks=len(counts),
        accesses=len(acc),
        never_reused=never,
        never_reused_share=never / len(counts) if len(counts) else 0.0,
        reuse_time_s=summarize(reuse_time),
        first_reuse_s=summarize(first_reuse),
        stack_distance_tokens=summarize(distances[distances != COLD] * block_tokens),
    )


def _hits(trace: Trace, acc: Accesses, served: np.ndarray) -> Hits:
    prompt_tokens = sum(r.input_tokens for r in trace.requests)
    blocks = np.count_nonzero(served) / max(1, len(acc))
    return Hits(float(blocks), float(acc.hit_tokens[served].sum()) / max(1, prompt_tokens))


def _kv(
    trace: Trace,
    acc: Accesses,
    hit: np.ndarray,
    bytes_per_token: int,
    transfer_gbps: float | None,
) -> Kv:
    counts = requests_per_block(acc)
    block_bytes = trace.block_tokens * bytes_per_token
    per_request = np.bincount(
        acc.request[hit], weights=acc.hit_tokens[hit], minlength=len(trace.requests)
    ) * bytes_per_token
    ts = np.array([r.ts_s for r in trace.requests])
    duration = float(ts.max() - ts.min())
    total = int(per_request.sum())
    per_second = np.bincount((ts - ts.min()).astype(np.int64), weights=per_request)
    budget = transfer_gbps * 1e9 if transfer_gbps else None
    return Kv(
        bytes_per_token=bytes_per_token,
        block_bytes=block_bytes,
        footprint_bytes=len(counts) * block_bytes,
        reused_footprint_bytes=int(np.count_nonzero(counts >= 2)) * block_bytes,
        hit_bytes=total,
        hit_bytes_per_request=summarize(per_request),
        mean_hit_bytes_per_s=total / duration if duration > 0 else 0.0,
        peak_hit_bytes_per_s=float(per_second.max()),
        transfer_gbps=transfer_gbps,
        load_ms_per_request=summarize(per_request / budget * 1e3) if budget else None,
        peak_budget_share=float(per_second.max()) / budget if budget else None,
    )


def _distributions(trace: Trace, acc: Accesses, distances: np.ndarray) -> Distributions:
    reuse_time, first_reuse = _reuse_times(acc)
    return Distributions(
        arrival_s=np.array([r.ts_s for r in trace.requests]),
        input_tokens=np.array([r.input_tokens for r in trace.requests]),
        output_tokens=np.array([r.output_tokens for r in trace.requests]),
        requests_per_block=requests_per_block(acc),
        reuse_time_s=reuse_time,
        first_reuse_s=first_reuse,
        stack_distance_tokens=distances[distances != COLD] * trace.block_tokens,
    )
