"""LRU scenarios: the oldest use leaves first."""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.policies import EvictionPolicy, make_eviction


def lru(*keys: str) -> EvictionPolicy[Hashable]:
    policy = make_eviction("lru", 8)
    for key in keys:
        policy.insert(key)
    return policy


def test_least_recently_used_leaves_first() -> None:
    """Scenario: four chunks are stored, then b and a are read again; c and d go first."""
    policy = lru("a", "b", "c", "d")
    policy.touch("b")
    policy.touch("a")
    assert policy.order() == ["c", "d", "b", "a"]
    assert policy.evict(2) == ["c", "d"]
    assert policy.order() == ["b", "a"]


def test_a_shared_prefix_that_keeps_being_read_outlives_the_rest() -> None:
    """Scenario: every request re-reads the system prompt while new chunks stream through a
    tier of four entries; the system prompt is never the victim."""
    policy = lru("system")
    victims: list[Hashable] = []
    for i in range(20):
        policy.touch("system")
        if len(policy) == 4:
            victims += policy.evict(1) or []
        policy.insert(f"user{i}")
    assert "system" in policy
    assert "system" not in victims
    assert victims[:3] == ["user0", "user1", "user2"]


def test_a_leased_oldest_chunk_is_skipped_and_stays_oldest() -> None:
    """Scenario: the oldest chunk is being read by a worker (protected) during an eviction."""
    policy = lru("a", "b", "c")
    assert policy.evict(1, {"a"}.__contains__) == ["b"]
    assert policy.order() == ["a", "c"]


def test_lru_remembers_nothing_about_evicted_keys() -> None:
    """Scenario: a chunk evicted a moment ago is stored again; it is simply the newest."""
    policy = lru("a", "b", "c")
    assert policy.evict(1) == ["a"]
    policy.insert("a")
    assert policy.order() == ["b", "c", "a"]
