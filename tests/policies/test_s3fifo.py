"""S3-FIFO scenarios: one-hit wonders leave through the small queue, re-used keys stay."""

from __future__ import annotations

import random
from collections.abc import Hashable

from kvtier.policies import EvictionPolicy, make_eviction
from kvtier.policies.s3fifo import S3FIFO


def access(policy: EvictionPolicy[Hashable], key: str, capacity: int) -> list[Hashable]:
    """A read-through tier of ``capacity`` entries; returns the keys a miss evicted."""
    if key in policy:
        policy.touch(key)
        return []
    victims = policy.evict(1) if len(policy) >= capacity else []
    assert victims is not None
    policy.insert(key)
    return victims


def evict_one(fifo: S3FIFO[str]) -> str:
    key = next(fifo.victims())
    fifo.evicted(key)
    return key


def test_one_hit_wonders_leave_before_reused_keys() -> None:
    """Scenario: ten chunks fill a tier of ten; k2 and k5 are read again while still in the
    small queue. Ten new chunks then arrive: every unread chunk leaves first, in arrival order,
    and k2 and k5 survive in main. LRU, for contrast, ends up dropping both."""
    first = [f"k{i}" for i in range(10)]
    new = [f"n{i}" for i in range(10)]
    evicted: dict[str, list[Hashable]] = {}
    for name in ("s3fifo", "lru"):
        policy = make_eviction(name, 10)
        evicted[name] = []
        for key in [*first, "k2", "k5", *new]:
            evicted[name] += access(policy, key, 10)
    assert evicted["s3fifo"] == ["k0", "k1", "k3", "k4", "k6", "k7", "k8", "k9", "n0", "n1"]
    assert {"k2", "k5"} <= set(evicted["lru"])


def test_a_key_back_from_the_ghost_queue_goes_to_main() -> None:
    """Scenario: a chunk evicted unread leaves its name in the ghost queue. When it is stored
    again soon after, it skips the small queue, so the small queue's keys leave before it."""
    fifo: S3FIFO[str] = S3FIFO(10)
    for i in range(10):
        fifo.insert(f"k{i}")
    assert evict_one(fifo) == "k0"
    assert fifo.ghost_count == 1
    fifo.insert("k0")
    assert fifo.in_main("k0")
    assert fifo.ghost_count == 0
    assert list(fifo.victims()) == [f"k{i}" for i in range(1, 10)] + ["k0"]


def test_a_key_forgotten_by_the_ghost_queue_starts_in_small() -> None:
    """Scenario: the ghost queue holds as many names as main (9 in a tier of 10); after ten
    more evictions the first victim's name is gone and it is a newcomer again."""
    fifo: S3FIFO[str] = S3FIFO(10)
    for i in range(12):
        fifo.insert(f"k{i}")
    for _ in range(11):
        evict_one(fifo)
    assert fifo.ghost_count == 9
    fifo.insert("k0")
    fifo.insert("k10")
    assert not fifo.in_main("k0")
    assert fifo.in_main("k10")


def test_each_pass_over_main_costs_a_key_one_hit() -> None:
    """Scenario: a, b and c are read while in the small queue, b three times. All three move
    to main; each pass over main takes one hit from each, so b, read most, leaves last."""
    fifo: S3FIFO[str] = S3FIFO(10)
    for key in "abc":
        fifo.insert(key)
        fifo.touch(key)
    fifo.touch("b")
    fifo.touch("b")
    assert list(fifo.victims()) == ["a", "c", "b"]
    assert evict_one(fifo) == "a"
    assert all(fifo.in_main(key) for key in "bc")
    assert list(fifo.victims()) == ["c", "b"]


def test_a_leased_one_hit_wonder_stays_first_in_line() -> None:
    """Scenario: the oldest unread chunk is being read by a worker during an eviction. It is
    skipped, not promoted, so it is the first victim once its lease ends."""
    policy = make_eviction("s3fifo", 10)
    for i in range(5):
        policy.insert(f"k{i}")
    assert policy.evict(1, {"k0"}.__contains__) == ["k1"]
    assert policy.order()[0] == "k0"
    assert policy.evict(1) == ["k0"]


def test_ghost_queue_stays_bounded_under_a_mixed_workload() -> None:
    """Scenario: a skewed random workload over 40 keys runs through a tier of 10; the ghost
    queue fills up but never holds more names than main's share (9)."""
    rng = random.Random(3)
    fifo: S3FIFO[str] = S3FIFO(10)
    peak = 0
    for _ in range(3000):
        key = f"k{min(rng.randrange(40), rng.randrange(40))}"
        if key in fifo:
            fifo.touch(key)
            continue
        if len(fifo) == 10:
            evict_one(fifo)
        fifo.insert(key)
        fifo.check_integrity()
        peak = max(peak, fifo.ghost_count)
    assert peak == 9
