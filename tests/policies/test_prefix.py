"""The prefix-aware algorithm: chains drain from the tail, returning chains stay longer.

The conformance suite runs it with no parent hints; these tests give it chains.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import EvictionPolicy
from kvtier.policies.prefix import PrefixAware


def chain_policy(capacity: int = 8, **kwargs: Any) -> tuple[EvictionPolicy[Hashable],
                                                             list[PrefixAware[Hashable]]]:
    made: list[PrefixAware[Hashable]] = []

    def make(cap: int) -> PrefixAware[Hashable]:
        made.append(PrefixAware(cap, **kwargs))
        return made[-1]

    return EvictionPolicy(make, capacity), made


def insert_chain(policy: EvictionPolicy[Hashable], keys: str, parent: str | None = None) -> None:
    """Insert ``keys`` as one chain after ``parent``, tail first as the store commits."""
    parents = [parent, *keys[:-1]]
    for key, up in reversed(list(zip(keys, parents, strict=True))):
        policy.insert(key, parent=up)


def assert_kids_first(order: list[Hashable], parent_of: dict[str, str]) -> None:
    position = {key: i for i, key in enumerate(order)}
    for kid, parent in parent_of.items():
        if kid in position and parent in position:
            assert position[kid] < position[parent], (kid, parent, order)


def test_a_chain_drains_from_its_tail_and_a_shared_head_waits_for_every_branch() -> None:
    policy, _ = chain_policy()
    insert_chain(policy, "abcd")
    insert_chain(policy, "ef", parent="b")
    order = policy.order()
    assert sorted(map(str, order)) == list("abcdef")
    assert_kids_first(order, {"b": "a", "c": "b", "d": "c", "e": "b", "f": "e"})
    assert order[-2:] == ["b", "a"]


def test_tail_first_inserts_wait_for_their_parent_and_count_as_unreachable() -> None:
    policy, made = chain_policy()
    policy.insert("c", parent="b")
    algo = made[0]
    assert algo.waiting == 1 == policy.unreachable()
    policy.insert("b", parent="a")
    assert algo.waiting == 1  # c hangs under b now; b waits for a
    assert policy.unreachable() == 2  # and neither can be reached
    policy.insert("a")
    assert algo.waiting == 0 == policy.unreachable()
    assert policy.order() == ["c", "b", "a"]
    algo.check_integrity()


def test_a_protected_leaf_keeps_its_whole_prefix() -> None:
    policy, _ = chain_policy()
    insert_chain(policy, "abc")
    assert policy.evict(1, {"c"}.__contains__) is None
    assert len(policy) == 3
    policy.insert("x")
    assert policy.evict(1, {"c"}.__contains__) == ["x"]
    assert policy.evict(3) == ["c", "b", "a"]


def test_evicting_a_parent_in_the_same_call_follows_its_last_kid() -> None:
    policy, made = chain_policy()
    insert_chain(policy, "ab")
    algo = made[0]
    policy.insert("x")  # newer than the chain: the chain's head leaves before it
    assert policy.evict(2) == ["b", "a"]
    assert policy.order() == ["x"]
    algo.check_integrity()


def test_a_hit_buys_reuse_bonus_times_capacity_uses() -> None:
    policy, _ = chain_policy(capacity=2, reuse_bonus=3.0)  # bonus: 6 steps
    policy.insert("x")  # step 1
    policy.insert("y")  # step 2
    policy.touch("x")  # step 3: score 9
    for key in "zwv":  # steps 4, 5, 6
        policy.insert(key)
    assert policy.order() == ["y", "z", "w", "v", "x"]
    for key in "ut":  # steps 7, 8
        policy.insert(key)
    assert policy.order()[-1] == "x"
    for key in "sr":  # steps 9, 10: s ties x's 3 + 6 and leaves first; r is newer
        policy.insert(key)
    assert policy.order()[-3:] == ["s", "x", "r"]


def test_a_continued_chain_earns_the_bonus_a_new_branch_does_not() -> None:
    policy, _ = chain_policy(capacity=4, reuse_bonus=1.0)
    insert_chain(policy, "ab")
    policy.insert("g", parent="b")  # the previous turn's partial block: b's other kid
    policy.touch("b")
    policy.touch("a")
    insert_chain(policy, "cd", parent="b")  # the next turn, after a chain that came back
    policy.insert("n")  # a fresh one-time prompt, inserted after it
    order = policy.order()
    assert order.index("n") < order.index("d")
    # b now has kids g and c: a third branch is not the same conversation
    policy.insert("e", parent="b")
    policy.insert("m")
    order = policy.order()
    assert order.index("e") < order.index("m")


def test_a_chunk_stored_again_while_its_ghost_is_kept_outlives_a_fresh_one() -> None:
    policy, _ = chain_policy(capacity=2, reuse_bonus=1.0, ghosts=1.0)
    policy.insert("x")
    assert policy.evict(1) == ["x"]
    policy.insert("x")  # came back: bonus
    policy.insert("y")
    assert policy.order() == ["y", "x"]
    without, _ = chain_policy(capacity=2, reuse_bonus=1.0, ghosts=0.0)
    without.insert("x")
    assert without.evict(1) == ["x"]
    without.insert("x")
    without.insert("y")
    assert without.order() == ["x", "y"]


def test_removing_a_parent_leaves_its_kids_waiting_until_it_is_back() -> None:
    policy, made = chain_policy()
    insert_chain(policy, "abc")
    algo = made[0]
    policy.remove("b")
    assert algo.waiting == 1 == policy.unreachable()
    assert sorted(map(str, policy.order())) == ["a", "c"]
    policy.insert("b", parent="a")
    assert algo.waiting == 0
    assert policy.order() == ["c", "b", "a"]
    algo.check_integrity()


# --- random operations: evictions never leave a kid behind its evicted parent -------------

KEYS = st.integers(0, 9)
PARENT = st.one_of(st.none(), KEYS)
OPS = st.one_of(
    st.tuples(st.just("insert"), KEYS, PARENT, st.sampled_from([35, 35, 35, 0, 80])),
    st.tuples(st.just("insert"), KEYS, PARENT, st.just(35)),
    st.tuples(st.just("touch"), KEYS),
    st.tuples(st.just("evict"), st.integers(0, 4), st.frozensets(KEYS, max_size=3)),
    st.tuples(st.just("evict"), st.integers(1, 2), st.just(frozenset())),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("priority"), KEYS, st.sampled_from([0, 35, 80])),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OPS, min_size=5, max_size=120), capacity=st.integers(1, 6),
       levels=st.sampled_from([1, 3]))
def test_evictions_never_strand_a_kid_of_the_same_priority(
    ops: list[tuple[Any, ...]], capacity: int, levels: int
) -> None:
    """Holes the contract allows: priority beats chains (a kid above its parent's priority
    outlives it; a kid below it leaves first unless protected). Within one priority a
    protected kid keeps its whole prefix, so no eviction strands a kid of its own priority;
    loops from hostile hints are refused rather than making keys unevictable."""
    policy, made = chain_policy(capacity, levels=levels)
    parent_of: dict[int, int] = {}
    looped = False  # a refused loop hint still counts in EvictionPolicy.unreachable
    for op in ops:
        kind, key = op[0], op[1]
        if kind == "insert":
            if key in policy:
                with pytest.raises(KeyError):
                    policy.insert(key, op[3], op[2])
                continue
            parent = op[2]  # may be the key itself or one of its kids: a loop is refused
            policy.insert(key, op[3], parent)
            loop = parent is not None and makes_loop(policy, parent_of, key, parent)
            looped = looped or loop
            if parent is None or loop:
                parent_of.pop(key, None)
            else:
                parent_of[key] = parent
        elif kind == "touch":
            policy.touch(key)
        elif kind == "remove":
            policy.remove(key)
        elif kind == "priority":
            policy.set_priority(key, op[2])
        else:
            check_eviction(policy, parent_of, key, op[2])
        for algo in made:
            algo.check_integrity()
        if not looped and len({policy.priority(k) for k in policy.order()}) <= 1:
            waiting = sum(a.waiting for a in made)
            assert waiting <= policy.unreachable() <= len(policy)
            assert (waiting == 0) == (policy.unreachable() == 0)


def makes_loop(policy: EvictionPolicy[Hashable], parent_of: dict[int, int], key: int,
               parent: int) -> bool:
    """True if ``parent`` is ``key`` or a present descendant of it: the hint is refused."""
    step: int | None = parent
    while step is not None and step in policy:
        if step == key:
            return True
        step = parent_of.get(step)
    return step == key


def check_eviction(policy: EvictionPolicy[Hashable], parent_of: dict[int, int], n: int,
                   protected: frozenset[int]) -> None:
    priority = {key: policy.priority(key) for key in policy.order()}
    victims = policy.evict(n, protected.__contains__)
    if victims is None:
        return
    assert len(victims) == n and not set(victims) & protected
    gone = set(victims)
    for kid, parent in parent_of.items():
        if parent in gone and kid in policy:
            low, high = priority[parent], priority[kid]
            assert low is not None and high is not None
            assert high != low, (kid, parent)
            assert high > low or kid in protected


def test_more_levels_keep_a_chunk_hit_more_often_longer() -> None:
    policy, _ = chain_policy(capacity=2, reuse_bonus=1.0, levels=3)  # bonus: 2 steps a level
    policy.insert("once")  # step 1
    policy.insert("twice")  # step 2
    policy.touch("once")  # step 3: 3 + 2
    policy.touch("twice")  # step 4
    policy.touch("twice")  # step 5: 5 + 4
    policy.insert("new")  # step 6
    assert policy.order() == ["once", "new", "twice"]


def test_all_or_nothing_holds_when_a_protected_leaf_hides_its_prefix() -> None:
    policy, _ = chain_policy()
    insert_chain(policy, "abc")
    insert_chain(policy, "de")
    before = policy.order()
    assert policy.evict(3, {"c"}.__contains__) is None
    assert policy.order() == before
    assert policy.evict(2, {"c"}.__contains__) == ["e", "d"]
