"""The prefix-aware policy in the simulator: parent hints reach it, and it leaves no holes
where LRU does."""

from __future__ import annotations

from trace_helpers import BT, req

from kvtier.trace.simulate import HOST, Simulator, TierSpec


def host(capacity: int, eviction: str) -> Simulator:
    return Simulator([TierSpec(HOST, capacity, eviction=eviction)], BT)


def test_an_extension_after_a_hit_drains_before_the_prefix_it_needs() -> None:
    """[1,2,3] then [1,2,3,4,5] fill 5 slots; a new [9,8] takes 2. LRU (tail first) gives up
    3 and 2, the oldest uses, and keeps 4 and 5 that nothing can reach behind the hole;
    prefix gives up the chain's tail, 5 and 4, and serves [1,2,3] whole afterwards."""
    trace = [req([1, 2, 3]), req([1, 2, 3, 4, 5]), req([9, 8]), req([1, 2, 3, 4, 5])]
    served: dict[str, list[int]] = {"lru": [], "prefix": []}
    unreachable: dict[str, list[int]] = {"lru": [], "prefix": []}
    for policy in ("lru", "prefix"):
        sim = host(5, policy)
        for r in trace:
            served[policy].append(len(sim.request(r)))
            unreachable[policy].append(sim.result().tier(HOST).unreachable)
    assert served["lru"] == [0, 3, 0, 1]
    assert served["prefix"] == [0, 3, 0, 3]
    assert unreachable["lru"] == [0, 0, 2, 0]  # 4 and 5 behind the 2 and 3 it gave up
    assert unreachable["prefix"] == [0, 0, 0, 0]


def test_the_simulator_hands_every_host_insert_its_parent() -> None:
    sim = host(100, "prefix")
    for r in [req([1, 2, 3]), req([1, 2, 4]), req([1, 5, 6, 7])]:
        sim.request(r)
    policy = sim.host.policy
    assert policy.unreachable() == 0
    order = policy.order()
    assert order.index(3) < order.index(2) and order.index(4) < order.index(2)
    assert order.index(7) < order.index(6) < order.index(5) < order.index(1)
    assert order.index(2) < order.index(1)


def test_a_lower_tier_gets_the_hints_too() -> None:
    sim = Simulator([TierSpec(HOST, 4, eviction="prefix"),
                     TierSpec("disk", 10, eviction="prefix")], BT)
    sim.request(req([1, 2, 3, 4]))
    disk = sim.lower[0].policy
    assert sorted(int(str(block)) for block in disk.order()) == [1, 2, 3, 4]
    assert disk.unreachable() == 0
    assert disk.order() == [4, 3, 2, 1]
