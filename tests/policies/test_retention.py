"""Retention with a duration: a priority that falls back to the default at its deadline,
lazily (where a victim is chosen or a priority read), in every algorithm."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import (
    DEFAULT_PRIORITY,
    EVICTION,
    MAX_RETAIN_S,
    RELEASE,
    EvictionPolicy,
    Retention,
    check_duration,
    effective,
    make_eviction,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture(params=sorted(EVICTION))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def policy_of(name: str, clock: Clock, capacity: int = 8) -> EvictionPolicy[Hashable]:
    return make_eviction(name, capacity, clock)


def test_a_retained_key_outlives_others_until_its_deadline(name: str) -> None:
    clock = Clock()
    policy = policy_of(name, clock)
    policy.insert("kept", 80, until=10.0)
    for key in ("b", "c"):
        policy.insert(key)
    clock.now = 9.9
    assert policy.retention("kept") == (80, 10.0)
    assert policy.evict(1) == ["b"]
    clock.now = 10.0
    assert policy.retention("kept") == (DEFAULT_PRIORITY, None)
    assert policy.expired == 1 and policy.retained == 0
    assert policy.evict(2) == ["c", "kept"]  # back at 35, as if stored at its deadline


def test_a_chain_set_together_falls_back_tail_first(name: str) -> None:
    clock = Clock()
    policy = policy_of(name, clock)
    chain = ["a", "b", "c", "d"]
    for key in reversed(chain):
        policy.insert(key)
    policy.set_priorities(chain, 90, until=5.0)
    policy.insert("newer")
    clock.now = 6.0
    assert policy.evict(5) == ["newer", "d", "c", "b", "a"]


def test_a_later_retention_extends_and_none_keeps_it(name: str) -> None:
    clock = Clock()
    policy = policy_of(name, clock)
    policy.insert("a", 80, until=5.0)
    policy.set_priority("a", 80, until=50.0)
    clock.now = 10.0
    assert policy.priority("a") == 80
    policy.set_priority("a", 80)  # no duration: kept until changed
    clock.now = 1e6
    assert policy.retention("a") == (80, None)


def test_a_deadline_already_past_stores_at_the_default(name: str) -> None:
    clock = Clock()
    clock.now = 100.0
    policy = policy_of(name, clock)
    policy.insert("late", 90, until=99.0)
    policy.insert("x", 90, until=200.0)
    policy.set_priority("x", 70, until=100.0)
    assert policy.retention("late") == (DEFAULT_PRIORITY, None)
    assert policy.retention("x") == (DEFAULT_PRIORITY, None)


def test_a_release_drops_a_prefix_below_everything(name: str) -> None:
    policy = policy_of(name, Clock())
    for key in ("a", "b", "c"):
        policy.insert(key, 80)
    policy.insert("d")
    policy.set_priorities(["a", "b"], RELEASE.priority)
    assert policy.evict(2) == ["b", "a"]


def test_expiry_costs_the_deadlines_due_not_the_keys() -> None:
    """No scan: with 20,000 keys and one deadline, choosing victims reads the clock once
    per choice and moves one key; re-setting one key's deadline keeps the heap bounded."""
    clock = Clock()
    policy = policy_of("lru", clock, capacity=20_000)
    for i in range(20_000):
        policy.insert(i)
    policy.set_priority(0, 90, until=1.0)
    for _ in range(1000):
        policy.set_priority(0, 90, until=1.0)
    assert policy._due_keys <= 2 * policy.retained + 64
    clock.now, clock.reads = 2.0, 0
    assert policy.evict(1) == [1]
    assert clock.reads <= 2 and policy.expired == 1


def test_a_bounded_expiry_moves_at_most_its_limit_per_call(name: str) -> None:
    """The store's housekeeping applies deadlines under its lock a batch at a time."""
    clock = Clock()
    policy = policy_of(name, clock, capacity=8)
    for i in range(6):
        policy.insert(i)
        policy.set_priority(i, 90, until=1.0 + i)
    clock.now = 10.0
    assert policy.has_due
    assert policy.expire(limit=4) == 4 and policy.has_due
    assert policy.expire(limit=4) == 2 and not policy.has_due
    assert policy.count_by_priority() == {DEFAULT_PRIORITY: 6}
    assert policy.expired == 6


@pytest.mark.parametrize("bad", [0, 0.0, -1, -1e-9, math.nan, math.inf, -math.inf,
                                 MAX_RETAIN_S + 1, 10**400, True, "30", [30]])
def test_bad_durations_are_refused_naming_what_is_allowed(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"duration_s must be"):
        check_duration(bad)
    with pytest.raises(ValueError, match=r"duration_s must be"):
        Retention(80, bad)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "5", True])
def test_bad_deadlines_are_refused_and_change_nothing(name: str, bad: Any) -> None:
    policy = policy_of(name, Clock())
    policy.insert("a")
    with pytest.raises(ValueError, match="until must be a finite time"):
        policy.insert("b", 80, until=bad)
    with pytest.raises(ValueError, match="until must be a finite time"):
        policy.set_priority("a", 80, until=bad)
    assert policy.order() == ["a"] and policy.retention("a") == (DEFAULT_PRIORITY, None)


def test_good_durations_and_the_default_never_fall_back() -> None:
    assert check_duration(None) is None and check_duration(MAX_RETAIN_S) == MAX_RETAIN_S
    assert check_duration(1) == 1.0
    assert Retention(80, 30.0).until(100.0) == 130.0
    assert Retention(80).until(100.0) is None
    assert Retention(DEFAULT_PRIORITY, 30.0).until(100.0) is None
    assert effective(80, 5.0, 4.9) == (80, 5.0) and effective(80, 5.0, 5.0) == (35, None)


# --- random operations, hostile values included, against a reference model ----------------

KEYS = st.integers(0, 6)
PRIORITIES = st.sampled_from([0, 35, 35, 50, 80, 100])
UNTILS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                   st.floats(0, 30))
OPS = st.one_of(
    st.tuples(st.just("insert"), KEYS, PRIORITIES, UNTILS),
    st.tuples(st.just("set"), st.lists(KEYS, max_size=4, unique=True), PRIORITIES, UNTILS),
    st.tuples(st.just("touch"), KEYS),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("evict"), st.integers(0, 3)),
    st.tuples(st.just("time"), st.floats(0, 20)),
)


def _apply(policy: EvictionPolicy[Hashable], clock: Clock,
           ref: dict[int, tuple[int, float | None]], op: tuple[Any, ...]) -> None:
    kind = op[0]
    bad_until = op[-1] is not None and not math.isfinite(op[-1])
    if kind == "insert":
        _, key, priority, until = op
        if bad_until or key in ref:
            with pytest.raises((ValueError, KeyError)):
                policy.insert(key, priority, until=until)
            return
        policy.insert(key, priority, until=until)
        ref[key] = _fresh(priority, until, clock.now)
    elif kind == "set":
        _, keys, priority, until = op
        if bad_until:
            with pytest.raises(ValueError):
                policy.set_priorities(keys, priority, until)
            return
        policy.set_priorities(keys, priority, until)
        for key in keys:
            if key in ref:
                ref[key] = _fresh(priority, until, clock.now)
    elif kind == "touch":
        policy.touch(op[1])
    elif kind == "remove":
        policy.remove(op[1])
        ref.pop(op[1], None)
    elif kind == "time":
        clock.now += op[1]
    else:
        now = {k: effective(p, u, clock.now)[0] for k, (p, u) in ref.items()}
        victims = policy.evict(op[1])
        if op[1] > len(ref):
            assert victims is None
            return
        assert victims is not None
        rest = [now[k] for k in ref if k not in victims]
        assert all(now[k] <= min(rest, default=100) for k in victims)
        for key in victims:
            del ref[key]


def _fresh(priority: int, until: float | None, now: float) -> tuple[int, float | None]:
    if priority == DEFAULT_PRIORITY:
        return priority, None
    return effective(priority, until, now) if until is not None else (priority, None)


@pytest.mark.parametrize("algorithm", sorted(EVICTION))
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(OPS, min_size=5, max_size=60))
def test_random_retentions_match_a_reference_model(algorithm: str,
                                                  ops: list[tuple[Any, ...]]) -> None:
    clock = Clock()
    policy = policy_of(algorithm, clock, capacity=4)
    ref: dict[int, tuple[int, float | None]] = {}
    for op in ops:
        _apply(policy, clock, ref, op)
        assert sorted(policy.order()) == sorted(ref)
        for key, (priority, until) in ref.items():
            assert policy.retention(key) == effective(priority, until, clock.now)
        assert policy.retained == sum(
            1 for p, u in ref.values() if effective(p, u, clock.now)[1] is not None)


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)))
def test_any_duration_is_either_a_bounded_number_or_a_clear_error(value: Any) -> None:
    try:
        checked = check_duration(value)
    except ValueError as exc:
        assert "duration_s must be" in str(exc)
        return
    assert checked is None if value is None else 0.0 < checked <= MAX_RETAIN_S


@pytest.mark.parametrize("name", ["lru", "arc", "s3fifo", "prefix"])
def test_a_replays_plain_tables_choose_the_same_victims_as_a_servers_sharded_ones(
        name: str) -> None:
    """The simulator's policies keep plain tables (``sharded=False``); a server's are sharded.
    The same operations, retentions and deadlines included, give the same evictions."""
    from kvtier.policies import make_eviction

    now = [0.0]
    policies = [make_eviction(name, 64, lambda: now[0], sharded=s) for s in (True, False)]
    rng = random.Random(7)
    held: list[int] = []
    for step in range(4000):
        now[0] = step * 0.01
        op = rng.random()
        if op < 0.5 or not held:
            key, priority = step, rng.choice([35, 35, 50, 80])
            until = now[0] + rng.choice([0.5, 3.0]) if priority != 35 else None
            parent = rng.choice(held) if held and rng.random() < 0.5 else None
            for p in policies:
                p.insert(key, priority, parent=parent, until=until)
            held.append(key)
        elif op < 0.8:
            key = rng.choice(held)
            for p in policies:
                p.touch(key)
        for p in policies:
            p.expire()
        outs = [p.evict(1) if len(held) > 60 else [] for p in policies]
        assert outs[0] == outs[1], step
        for key in outs[0] or ():
            held.remove(key)
    assert policies[0].order() == policies[1].order()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=40), st.integers(0, 39),
       st.integers(1, 15), st.integers(36, 100))
def test_under_lru_a_short_retention_is_a_recency_bonus(
        uses: list[int], retained_at: int, bonus: int, priority: int) -> None:
    """A guess (the next turn within D s) is a soft, expiring bonus when it is a short
    retention: under LRU, a key retained above the default for D s at time t leaves, among
    keys at the default, exactly where a key last used at t + D would (the deadline applied
    when it passes, as a store that chooses victims all the time does). Keys are used one a
    second, hits and stores alike; at step ``retained_at`` the key just used gets the
    retention (re-used before it expires, it keeps it: a bonus on the use that set it)."""
    clock = Clock()
    policy: EvictionPolicy[Hashable] = make_eviction("lru", 100, clock)
    last: dict[int, float] = {}
    bonus_until: dict[int, float] = {}
    for step, key in enumerate(uses):
        clock.now = float(step)
        policy.expire()
        if key in policy:
            policy.touch(key)
        else:
            policy.insert(key)
        last[key] = clock.now
        if step == retained_at:
            policy.set_priority(key, priority, until=clock.now + bonus)
            bonus_until[key] = clock.now + bonus
    clock.now = float(len(uses))
    held = [k for k in policy.order() if policy.retention(k) == (DEFAULT_PRIORITY, None)]
    # the reference: each key by its last use, the retained one's moved to its deadline if
    # that passed (a key still retained is not at the default and not compared)
    virtual = {k: max(t, bonus_until.get(k, -1.0)) for k, t in last.items() if k in held}
    assert held == sorted(held, key=lambda k: (virtual[k], k not in bonus_until))
