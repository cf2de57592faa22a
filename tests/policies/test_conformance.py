"""The eviction-policy contract, run against every registered algorithm.

Each algorithm only orders keys; :class:`EvictionPolicy` adds priorities, protection and the
all-or-nothing rule. A new algorithm passes this suite by being registered in EVICTION.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol, runtime_checkable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import UnknownBackendError
from kvtier.policies import DEFAULT_PRIORITY, EVICTION, Algorithm, EvictionPolicy, make_eviction

CAPACITY = 8


@pytest.fixture(params=sorted(EVICTION))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def filled(name: str, keys: list[str]) -> EvictionPolicy[Hashable]:
    policy = make_eviction(name, CAPACITY)
    for key in keys:
        policy.insert(key)
    return policy


def never(key: Hashable) -> bool:
    return False


def test_every_built_in_algorithm_is_registered() -> None:
    assert set(EVICTION) == {"lru", "arc", "s3fifo", "prefix"}


def test_unknown_algorithm_lists_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match="known: arc, lru, prefix, s3fifo"):
        make_eviction("mru", CAPACITY)


def test_evict_returns_n_victims_and_forgets_them(name: str) -> None:
    policy = filled(name, ["a", "b", "c", "d"])
    victims = policy.evict(3)
    assert victims is not None and len(set(victims)) == 3
    assert len(policy) == 1
    assert all(key not in policy for key in victims)


def test_evict_zero_returns_an_empty_list(name: str) -> None:
    policy = filled(name, ["a"])
    assert policy.evict(0) == []
    assert len(policy) == 1


def test_evict_is_all_or_nothing(name: str) -> None:
    policy = filled(name, ["a", "b", "c", "d"])
    policy.touch("c")
    before = policy.order()
    protected = {"a", "c"}.__contains__
    assert policy.evict(3, protected) is None
    assert policy.order() == before
    assert len(policy) == 4
    assert sorted(policy.evict(2, protected) or []) == ["b", "d"]


def test_protected_keys_are_never_returned(name: str) -> None:
    policy = filled(name, [f"k{i}" for i in range(6)])
    protected = {"k0", "k2", "k5"}
    victims = policy.evict(3, protected.__contains__)
    assert sorted(victims or []) == ["k1", "k3", "k4"]
    assert sorted(policy.order()) == sorted(protected)


def test_victims_follow_order_and_leave_the_rest_of_it(name: str) -> None:
    policy = filled(name, [f"k{i}" for i in range(6)])
    policy.touch("k1")
    policy.touch("k4")
    before = policy.order()
    assert policy.evict(2) == before[:2]
    assert policy.order() == before[2:]


def test_lower_priority_is_always_evicted_first(name: str) -> None:
    policy = make_eviction(name, CAPACITY)
    for i, priority in enumerate([80, 0, 35, 100, 35, 0, 80]):
        policy.insert((priority, i), priority)
    for _ in range(3):  # hits never lift a key above a higher priority
        policy.touch((0, 1))
        policy.touch((0, 5))
    victims = policy.evict(len(policy))
    assert [priority for priority, _ in victims or []] == [0, 0, 35, 35, 80, 80, 100]


def test_default_priority_is_35(name: str) -> None:
    policy = filled(name, ["a"])
    assert policy.priority("a") == DEFAULT_PRIORITY == 35
    assert policy.priority("missing") is None


@pytest.mark.parametrize("bad", [-1, 101, 3.5, True, "35", None])
def test_bad_priorities_raise_naming_the_range(name: str, bad: object) -> None:
    policy = filled(name, ["a"])
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        policy.insert("b", bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        policy.set_priority("a", bad)  # type: ignore[arg-type]
    assert policy.order() == ["a"]
    assert policy.priority("a") == 35


def test_duplicate_insert_raises_key_error(name: str) -> None:
    policy = filled(name, ["a"])
    with pytest.raises(KeyError, match="already tracked"):
        policy.insert("a", 90)
    assert policy.priority("a") == 35
    assert len(policy) == 1


def test_touch_and_remove_of_unknown_keys_change_nothing(name: str) -> None:
    policy = filled(name, ["a", "b"])
    before = policy.order()
    policy.touch("zz")
    policy.remove("zz")
    policy.set_priority("zz", 90)
    assert policy.order() == before
    assert len(policy) == 2
    assert "zz" not in policy


def test_len_contains_and_order_agree(name: str) -> None:
    policy = filled(name, ["a", "b", "c"])
    policy.insert("d", 90)
    policy.remove("b")
    policy.touch("a")
    assert len(policy) == 3
    assert sorted(policy.order()) == ["a", "c", "d"]
    assert [key in policy for key in "abcd"] == [True, False, True, True]
    assert policy.order()[-1] == "d"


def test_set_priority_moves_a_key(name: str) -> None:
    policy = filled(name, ["a", "b", "c"])
    policy.set_priority("a", 90)
    policy.set_priority("c", 0)
    assert policy.priority("a") == 90
    assert policy.order()[0] == "c"
    assert policy.order()[-1] == "a"
    assert policy.evict(1) == ["c"]


@pytest.mark.parametrize("hinted", [False, True], ids=["no-parents", "parents"])
def test_a_reprioritised_chain_still_leaves_tail_first(name: str, hinted: bool) -> None:
    """A request re-prioritises its prefix head first; the tail must still leave first (a
    head that leaves first makes the rest of its chain unreachable)."""
    policy = make_eviction(name, CAPACITY)
    chain = ["a", "b", "c", "d"]
    for i in reversed(range(len(chain))):  # stored as a commit stores it: tail first
        policy.insert(chain[i], parent=chain[i - 1] if hinted and i else None)
    policy.insert("other")
    policy.set_priorities(chain, 80)
    assert policy.evict(1) == ["other"]
    assert policy.evict(4) == ["d", "c", "b", "a"]


def test_an_evicted_key_can_be_stored_again(name: str) -> None:
    policy = filled(name, ["a", "b"])
    victims = policy.evict(2)
    assert victims is not None
    for key in victims:
        policy.insert(key)
    assert sorted(policy.order()) == ["a", "b"]


# --- random operation sequences against a reference dict ------------------------------------


@runtime_checkable
class _Ghosting(Protocol):
    """Algorithms that remember names of evicted keys (ARC, S3-FIFO); LRU does not."""

    @property
    def ghost_count(self) -> int: ...

    def check_integrity(self) -> None: ...


def tracked(name: str, capacity: int) -> tuple[EvictionPolicy[Hashable], list[Algorithm[Hashable]]]:
    """Like make_eviction, but keeps every bucket's algorithm so the test can inspect it."""
    made: list[Algorithm[Hashable]] = []

    def make(cap: int) -> Algorithm[Hashable]:
        made.append(EVICTION[name](cap))
        return made[-1]

    return EvictionPolicy(make, capacity), made


Op = tuple[Any, ...]
# Few keys, mostly one priority and many inserts and evictions, so ghost lists fill up.
KEYS = st.integers(0, 7)
PRIORITIES = st.sampled_from([0, 35, 35, 35, 35, 80])
INSERT = st.tuples(st.just("insert"), KEYS, PRIORITIES)
TOUCH = st.tuples(st.just("touch"), KEYS)
EVICT = st.tuples(st.just("evict"), st.integers(0, 3), st.frozensets(KEYS, max_size=3))
OPS = st.one_of(
    INSERT,
    INSERT,
    TOUCH,
    TOUCH,
    EVICT,
    EVICT,
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("priority"), KEYS, PRIORITIES),
)


def apply(policy: EvictionPolicy[Hashable], ref: dict[int, int], op: Op) -> None:
    kind, key = op[0], op[1]
    if kind == "insert" and key in ref:
        with pytest.raises(KeyError):
            policy.insert(key, op[2])
    elif kind == "insert":
        policy.insert(key, op[2])
        ref[key] = op[2]
    elif kind == "touch":
        policy.touch(key)
    elif kind == "remove":
        policy.remove(key)
        ref.pop(key, None)
    elif kind == "priority":
        policy.set_priority(key, op[2])
        if key in ref:
            ref[key] = op[2]
    elif kind == "evict":
        check_evict(policy, ref, n=key, protected=op[2])


def check_evict(
    policy: EvictionPolicy[Hashable], ref: dict[int, int], n: int, protected: frozenset[int]
) -> None:
    before = policy.order()
    victims = policy.evict(n, protected.__contains__)
    free = [key for key in ref if key not in protected]
    if len(free) < n:
        assert victims is None
        assert policy.order() == before
        return
    assert victims is not None and len(set(victims)) == n
    assert all(key in ref and key not in protected for key in victims)
    survivors = [ref[key] for key in free if key not in victims]
    assert all(ref[key] <= min(survivors, default=100) for key in victims)
    if not protected:
        assert policy.order() == before[n:]
    for key in victims:
        del ref[key]


@pytest.mark.parametrize("algorithm", sorted(EVICTION))
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, min_size=10, max_size=80), capacity=st.integers(1, 5))
def test_random_operations_match_a_reference_set(
    algorithm: str, ops: list[Op], capacity: int
) -> None:
    policy, made = tracked(algorithm, capacity)
    ref: dict[int, int] = {}
    for op in ops:
        apply(policy, ref, op)
        assert len(policy) == len(ref)
        assert sorted(policy.order()) == sorted(ref)
        assert all(policy.priority(key) == priority for key, priority in ref.items())
        for algo in made:
            if isinstance(algo, _Ghosting):
                assert algo.ghost_count <= capacity
                algo.check_integrity()
