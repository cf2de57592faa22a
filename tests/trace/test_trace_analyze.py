"""``analyze`` on trace A: every figure is worked out by hand in the docstrings."""

from __future__ import annotations

import math

import pytest
from trace_helpers import BT, trace_a

from kvtier.trace.analyze import Analysis, analyze
from kvtier.trace.formats import Trace


def analysis(bytes_per_token: int | None = None, gbps: float | None = None) -> Analysis:
    trace = Trace(trace_a(), BT, "mooncake", "trace-a")
    return analyze(trace, bytes_per_token, transfer_gbps=gbps)[0]


def test_arrivals() -> None:
    """Arrivals at 0, 10, 15, 40 s: 3 gaps over 40 s = 0.075 req/s; gaps 10, 5, 25 have
    mean 40/3 and population std sqrt(650)/3, so CV = sqrt(650)/40 = 0.6374."""
    a = analysis().arrivals
    assert (a.requests, a.duration_s) == (4, 40.0)
    assert a.rate_per_s == pytest.approx(0.075)
    assert a.interarrival_cv == pytest.approx(math.sqrt(650) / 40)


def test_never_reused_share() -> None:
    """Blocks 1..6 are in 4, 3, 2, 1, 1, 1 requests: 4, 5, 6 never reused -> 3 of 6."""
    reuse = analysis().reuse
    assert (reuse.blocks, reuse.accesses, reuse.never_reused) == (6, 12, 3)
    assert reuse.never_reused_share == pytest.approx(0.5)


def test_reuse_times_and_first_reuse() -> None:
    """Reuses: 1 at 10 s (after 0), 2 at 10 (after 0), 1 at 15 (after 10), 1 at 40 (after 15),
    2 at 40 (after 10), 3 at 40 (after 0): 10, 10, 5, 25, 30, 40 -> mean 20, max 40.
    First reuse after creation: block 1 10 s, block 2 10 s, block 3 40 s -> mean 20."""
    reuse = analysis().reuse
    assert reuse.reuse_time_s.count == 6
    assert reuse.reuse_time_s.mean == pytest.approx(20.0)
    assert reuse.reuse_time_s.max == 40.0
    assert reuse.first_reuse_s.count == 3
    assert reuse.first_reuse_s.mean == pytest.approx(20.0)


def test_stack_distance_in_tokens() -> None:
    """Stack distances of the reuses 3, 3, 3, 2, 4, 5 chunks (see test_trace_reuse), times
    512 tokens: mean 20/6 * 512 = 1706.7, max 2560, median 3 * 512 = 1536."""
    sd = analysis().reuse.stack_distance_tokens
    assert sd.count == 6
    assert sd.mean == pytest.approx(20 / 6 * 512)
    assert (sd.p50, sd.max) == (1536.0, 2560.0)


def test_infinite_hits() -> None:
    """Infinite cache: 6 of 12 blocks (r2 1, 2; r3 1; r4 1, 2, 3), all full: tokens 0.5 too.
    Host sizes for a share of it are replayed (test_trace_recommend), not analysed: the
    store's LRU has no one-pass curve (test_trace_reuse)."""
    hits = analysis().hits
    assert hits.block_hit_ratio == pytest.approx(0.5)
    assert hits.token_hit_ratio == pytest.approx(0.5)


def test_sharing_and_hottest_prefixes() -> None:
    """Requests per block: 1:4, 2:3, 3:2, 4,5,6:1. Maximal shared prefixes (no child shared
    as widely): 1 (children 2:3, 5:1), 2 (children 3:2, 4:1), 3 (child 6:1).
    Reused tokens (requests - 1) * prefix: 2 -> 2 * 1024 = 2048; 1 -> 3 * 512 = 1536;
    3 -> 1 * 1536 = 1536 (tie broken by more requests: 1 before 3)."""
    s = analysis().sharing
    assert (s.unique_blocks, s.shared_blocks) == (6, 3)
    assert [(h.block, h.blocks, h.requests, h.reused_tokens) for h in s.hottest] == [
        ("2", 2, 3, 2048), ("1", 1, 4, 1536), ("3", 3, 2, 1536)]
    buckets = {(b.low, b.high): b.count for b in s.requests_per_block}
    assert buckets == {(1, 1): 3, (2, 2): 1, (3, 4): 2}


def test_kv_bytes() -> None:
    """2 bytes per token: 1024 per block; footprint 6 blocks = 6144, reused 3 = 3072.
    Infinite-cache loads: r2 2 blocks, r3 1, r4 3 -> 6 * 1024 = 6144 bytes over 40 s.
    At 1e-6 GB/s = 1000 B/s, r4's 3072 bytes take 3072 ms; the busiest second (t=40)
    carries 3072 bytes = 307.2% of the budget."""
    kv = analysis(bytes_per_token=2, gbps=1e-6).kv
    assert kv is not None
    assert (kv.block_bytes, kv.footprint_bytes, kv.reused_footprint_bytes) == (1024, 6144, 3072)
    assert kv.hit_bytes == 6144
    assert kv.mean_hit_bytes_per_s == pytest.approx(6144 / 40)
    assert kv.load_ms_per_request is not None
    assert kv.load_ms_per_request.max == pytest.approx(3072.0)
    assert kv.peak_budget_share == pytest.approx(3.072)
