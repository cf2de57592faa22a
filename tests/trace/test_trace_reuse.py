"""Reuse distances and the unbounded-cache hits, checked against hand-worked values; and why
the store's LRU has no one-pass curve."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_helpers import BT, req, trace_a

from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.reuse import (
    COLD,
    flatten,
    infinite_hits,
    next_use,
    previous_use,
    stack_distances,
)
from kvtier.trace.simulate import HOST, Simulator, TierSpec, simulate

C = COLD


def test_stack_distances_of_trace_a() -> None:
    """Trace A flattened: positions 0..11 hold blocks 1 2 3 | 1 2 4 | 1 5 | 1 2 3 6.

    pos 3 (1): since pos 0 saw {2,3}        -> 1 + 2 = 3
    pos 4 (2): since pos 1 saw {3,1}        -> 3
    pos 6 (1): since pos 3 saw {2,4}        -> 3
    pos 8 (1): since pos 6 saw {5}          -> 2
    pos 9 (2): since pos 4 saw {4,1,5}      -> 4
    pos 10 (3): since pos 2 saw {1,2,4,5}   -> 5
    first uses (pos 0, 1, 2, 5, 7, 11) are cold.
    """
    acc = flatten(trace_a())
    assert stack_distances(acc.ids).tolist() == [C, C, C, 3, 3, C, 3, C, 2, 4, 5, C]


def test_previous_and_next_use() -> None:
    """Blocks 1 2 3 | 1 2 4 | ...: block 1 is used at 0, 3, 6, 8; block 6 only at 11."""
    acc = flatten(trace_a())
    prev, nxt = previous_use(acc.ids), next_use(acc.ids)
    assert [prev[i] for i in (0, 3, 6, 8)] == [-1, 0, 3, 6]
    assert [nxt[i] for i in (0, 3, 6, 8)] == [3, 6, 8, 12]
    assert nxt[11] == 12


def test_infinite_hits_need_the_whole_prefix_seen_before() -> None:
    """Trace A: r1 [1,2,3] all new; r2 [1,2,4]: 1, 2 seen, 4 new; r3 [1,5]: 5 new;
    r4 [1,2,3,6]: 6 new. An unbounded cache serves 1 2 | 1 | 1 2 3: 6 of 12 accesses.
    A repeat inside one request is not served: the lookup happens before the request."""
    assert infinite_hits(flatten(trace_a())).astype(int).tolist() == [
        0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0]
    assert infinite_hits(flatten([req([7, 7]), req([7, 8, 7])])).tolist() == [
        False, False, True, False, False]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_stack_distances_agree_with_counting_by_hand(ids: list[int]) -> None:
    """Against the definition: 1 + distinct other ids since the previous use."""
    expected: list[int] = []
    last: dict[int, int] = {}
    for t, key in enumerate(ids):
        expected.append(1 + len(set(ids[last[key] + 1 : t])) if key in last else C)
        last[key] = t
    assert stack_distances(np.array(ids, dtype=np.int64)).tolist() == expected


def test_unbounded_hits_equal_the_simulator() -> None:
    """An unbounded host evicts nothing, so recency order does not matter: the one-pass
    figure must give exactly the simulator's block and token hit ratios."""
    requests = generate(GenConfig(sessions=60, seed=5, think_time_s=120.0))
    acc = flatten(requests)
    served = infinite_hits(acc)
    prompt = sum(r.input_tokens for r in requests)
    result = simulate(requests, [TierSpec(HOST, None)], BT)
    assert np.count_nonzero(served) == result.counts.hit_blocks
    assert acc.hit_tokens[served].sum() / prompt == pytest.approx(result.token_hit_ratio,
                                                                 abs=1e-12)


@pytest.mark.parametrize("capacity", [1, 7, 40, 150])
def test_lru_hosts_of_adjacent_sizes_break_inclusion(capacity: int) -> None:
    """What the old one-pass curve relied on, at each size: after every request the host of
    C chunks holds a subset of what the host of C + 1 holds (the inclusion property of stack
    algorithms, which lets one recency stack serve every size). With the store's tail-first
    order it fails on this generated trace at every size that evicts (and on the tiny trace
    below), so no stack-distance curve can equal the simulator and sizes are replayed."""
    requests = generate(GenConfig(sessions=60, seed=5, think_time_s=120.0))
    small, large = (Simulator([TierSpec(HOST, c)], BT) for c in (capacity, capacity + 1))
    broken = 0
    for request in requests:
        small.request(request)
        large.request(request)
        broken += not set(small.host.policy.order()) <= set(large.host.policy.order())
    assert broken > 0


def test_the_store_order_is_not_a_stack_algorithm() -> None:
    """LRU hosts of 3 and 4 chunks on [1,5,16] [2] [1,5,16] [2,8] (lists oldest first).

    3 chunks: r1 commits 16, 5, 1 -> [16,5,1]; r2: 2 evicts 16 -> [5,1,2];
              r3: prefix 1, 5 (16 is gone): touch 5, 1 -> [2,5,1]; 16 evicts 2 and is
              committed last -> [5,1,16]; r4: 2 evicts 5, 8 evicts 1 -> [16,8,2]
    4 chunks: r1 [16,5,1]; r2 [16,5,1,2]; r3: prefix 1, 5, 16, touched tail first
              -> [2,16,5,1]: 16, a hit, is now the least recent; r4: prefix 2, touch it;
              8 evicts 16 -> [5,1,2,8]
    The smaller host keeps 16, the larger one does not: in r3 the larger host served 16
    (touched first, so it ended least recent) and the smaller one recomputed it (committed,
    so it ended most recent). Hits 2 and 4.
    """
    requests = [req([1, 5, 16]), req([2]), req([1, 5, 16]), req([2, 8])]
    small, large = Simulator([TierSpec(HOST, 3)], BT), Simulator([TierSpec(HOST, 4)], BT)
    for request in requests:
        small.request(request)
        large.request(request)
    assert small.host.policy.order() == [16, 8, 2]
    assert large.host.policy.order() == [5, 1, 2, 8]
    assert (small.counts.hit_blocks, large.counts.hit_blocks) == (2, 4)


def test_a_larger_lru_host_can_hit_less() -> None:
    """LRU hosts of 2 and 3 chunks on [1] [2,7] [1,4,13,40] [1,4]: a request longer than
    the host reserves every slot and the rest of it is refused.

    2 chunks: r1 [1]; r2: 2 takes the free slot, 7 evicts 1 -> [7,2]; r3: 1 nowhere:
              1 evicts 7, 4 evicts 2, 13 and 40 find only reserved slots: refused
              -> [4,1]; r4: prefix 1, 4 -> 2 hits
    3 chunks: r1 [1]; r2 -> [1,7,2]; r3: prefix 1 (a hit) -> [7,2,1]; 4, 13, 40 evict
              7, 2, 1 -> [40,13,4]; r4: 1 nowhere -> 1 hit in all
    So hit ratio need not grow with size, and the sizing search can only assume it does.
    """
    requests = [req([1]), req([2, 7]), req([1, 4, 13, 40]), req([1, 4])]
    hits = [simulate(requests, [TierSpec(HOST, c)], BT).counts.hit_blocks for c in (2, 3)]
    assert hits == [2, 1]
