"""Belady's offline optimum: hand-worked on trace A, and a ceiling over every policy."""

from __future__ import annotations

import pytest
from trace_helpers import BT, trace_a

from kvtier.policies import EVICTION
from kvtier.trace.belady import belady
from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.simulate import HOST, TierSpec, simulate


def test_belady_capacity_two_on_trace_a() -> None:
    """Next uses (stream positions; 12 = never): 1@0->3, 2@1->4, 3@2->10, ...

    r1: keep 1 (next 3), 2 (next 4); 3 (next 10) is needed later than both: bypassed.
    r2 [1,2,4]: 1, 2 present -> 2 hits; now 1->6, 2->9; 4 (never) bypassed.
    r3 [1,5]: 1 present -> 1 hit; 1->8; 5 (never) bypassed.
    r4 [1,2,3,6]: 1, 2 present, 3 not -> 2 hits.
    5 of 12, where LRU at 2 chunks gets 1.
    """
    counts = belady(trace_a(), 2)
    assert counts.hit_blocks == 5
    assert counts.block_hit_ratio == pytest.approx(5 / 12)


def test_belady_capacity_three_reaches_the_infinite_cache() -> None:
    """With 3 chunks, 1, 2, 3 stay (4 and 5 are never used again, so bypassed):
    r2 2 hits, r3 1, r4 3 -> 6 of 12, the infinite-cache ratio."""
    assert belady(trace_a(), 3).hit_blocks == 6
    assert belady(trace_a(), None).hit_blocks == 6


def test_belady_never_below_any_policy_on_a_generated_trace() -> None:
    """The ceiling line of --sweep: at every size, no store policy beats the offline optimum
    (LRU, ARC and S3-FIFO through the same prefix-hit rule)."""
    requests = generate(GenConfig(sessions=150, seed=11, think_time_s=90.0))
    for capacity in (10, 50, 200, 800):
        best = belady(requests, capacity).block_hit_ratio
        for policy in EVICTION:
            tiers = [TierSpec(HOST, capacity, policy)]
            ratio = simulate(requests, tiers, BT).block_hit_ratio
            assert best >= ratio, (policy, capacity)
