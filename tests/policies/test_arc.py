"""ARC scenarios: scan resistance and learning the recency/frequency split from ghosts."""

from __future__ import annotations

import random
from collections.abc import Hashable

from kvtier.policies import EvictionPolicy, make_eviction
from kvtier.policies.arc import ARC


def access(policy: EvictionPolicy[Hashable], key: str, capacity: int) -> None:
    """A read-through tier of ``capacity`` entries: a hit touches, a miss stores the key."""
    if key in policy:
        policy.touch(key)
        return
    if len(policy) >= capacity:
        assert policy.evict(1) is not None
    policy.insert(key)


def evict_one(arc: ARC[str]) -> str:
    key = next(arc.victims())
    arc.evicted(key)
    return key


def test_frequently_read_keys_survive_a_scan_that_flushes_lru() -> None:
    """Scenario: four hot chunks are read twice, then 100 one-time chunks stream through a
    tier of eight. ARC keeps the hot chunks in T2 while the scan only churns T1; LRU loses
    every one of them."""
    hot = [f"hot{i}" for i in range(4)]
    scan = [f"scan{i}" for i in range(100)]
    survivors = {}
    for name in ("arc", "lru"):
        policy = make_eviction(name, 8)
        for key in hot + hot + scan:
            access(policy, key, 8)
        survivors[name] = [key for key in hot if key in policy]
    assert survivors == {"arc": hot, "lru": []}


def test_ghost_hits_move_the_target_both_ways() -> None:
    """Scenario: a key evicted from T1 comes straight back, so T1 was too small and its
    target grows; later a key evicted from T2 comes back and the target shrinks again."""
    arc: ARC[str] = ARC(4)
    for key in "abcd":
        arc.insert(key)
    assert arc.target == 0.0
    assert evict_one(arc) == "a"
    arc.insert("a")  # a B1 ghost: it goes to T2, not T1
    assert arc.target == 1.0
    # T1 = [b, c, d] gives up keys until it is down to the target, then T2 = [a] is next.
    assert list(arc.victims()) == ["b", "c", "a", "d"]

    arc.touch("b")  # T1 = [c, d], T2 = [a, b]
    assert evict_one(arc) == "c"
    assert evict_one(arc) == "a"  # T1 is at its target, so T2's oldest goes to B2
    arc.insert("a")
    assert arc.target == 0.0
    assert list(arc.victims()) == ["d", "b", "a"]


def test_long_forgotten_names_do_not_adapt_the_target() -> None:
    """Scenario: two hot keys sit in T2 while a scan of 50 keys passes through the other two
    slots of a tier of four. B1 only keeps as many names as T1 leaves room for, so the first
    scanned key is a plain miss when it returns, while the latest victim is recognised."""
    arc: ARC[str] = ARC(4)
    for key in ("hot0", "hot1"):
        arc.insert(key)
        arc.touch(key)
    for i in range(50):
        if len(arc) == 4:
            evict_one(arc)
        arc.insert(f"scan{i}")
    assert list(arc.victims()) == ["scan48", "scan49", "hot0", "hot1"]
    assert arc.ghost_count == 2  # |T1| + |B1| <= capacity
    assert evict_one(arc) == "scan48"
    arc.insert("scan0")
    assert arc.target == 0.0
    assert evict_one(arc) == "scan49"
    arc.insert("scan48")
    assert arc.target == 1.0
    arc.check_integrity()


def test_ghost_lists_stay_within_capacity_under_a_mixed_workload() -> None:
    """Scenario: a skewed random workload over 12 keys runs through a tier of four, filling
    both ghost lists; together they never hold more than four names."""
    rng = random.Random(7)
    arc: ARC[str] = ARC(4)
    peak = 0
    for _ in range(2000):
        key = f"k{min(rng.randrange(12), rng.randrange(12))}"
        if key in arc:
            arc.touch(key)
            continue
        if len(arc) == 4:
            evict_one(arc)
        arc.insert(key)
        arc.check_integrity()
        peak = max(peak, arc.ghost_count)
        assert len(arc) <= 4
    assert peak == 4
    assert 0.0 < arc.target < 4.0
