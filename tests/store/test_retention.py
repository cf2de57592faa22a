"""Retention in the store: a request's priority for its prefix, in the arena and below."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    PAYLOAD,
    SLOT_BYTES,
    TOKENS,
    MakeStore,
    keys,
    load,
    sample,
    store_chunks,
)

from kvtier.errors import InvalidRequest
from kvtier.policies import DEFAULT_PRIORITY


def test_a_reprioritised_prefix_leaves_the_arena_tail_first(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    """Scenario: a request lowers its whole prefix; the next store must take its tail, not
    its head (a head gone first leaves the rest unreachable), and so must the disk tier."""
    store = make_store(tmp_path, slots=5, disk_bytes=6 * CHUNK_BYTES)
    chain = keys(4)
    store_chunks(store, chain)
    store_chunks(store, keys(1, "cold"))
    store.flush(5.0)
    store.set_priority(chain, 10)
    store_chunks(store, keys(1, "new"))
    store.flush(5.0)
    assert [store.lookup([key]) for key in chain] == [["arena"]] * 3 + [["disk"]]
    disk = store.tiers[0].policy.order()
    assert disk[:4] == chain[::-1]  # the disk's order: the tail leaves first there too
    store.check_integrity()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_timed_retention_keeps_a_prefix_then_falls_back(tmp_path: Path,
                                                          make_store: MakeStore) -> None:
    """Scenario: an agent's turn ends in a tool call; its prefix is kept at 80 for 30 s.
    Within them, other traffic evicts around it; after them, it is an ordinary chunk again,
    in the arena and in the disk tier's books (no sweep ran: the deadline is read lazily)."""
    clock = Clock()
    store = make_store(tmp_path, slots=3, disk_bytes=20 * CHUNK_BYTES, clock=clock)
    session = keys(2, "session")
    store_chunks(store, session, priority=80, retain_s=30.0)
    store.flush(5.0)
    assert store.tiers[0].policy.retention(session[0]) == (80, 1030.0)
    for n in range(3):
        store_chunks(store, keys(1, f"tool{n}"))
        store.flush(5.0)
    assert [store.lookup([key]) for key in session] == [["arena"]] * 2
    clock.now += 30.0
    assert store.index.policy.retention(session[0]) == (DEFAULT_PRIORITY, None)
    assert store.tiers[0].policy.retention(session[1]) == (DEFAULT_PRIORITY, None)
    for n in range(3):
        store_chunks(store, keys(1, f"later{n}"))
        store.flush(5.0)
    assert store.lookup(session) == ["disk", "disk"]
    store.check_integrity()


def test_a_release_drops_a_prefix_first_and_a_promotion_keeps_retention(
        tmp_path: Path, make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(tmp_path, slots=4, disk_bytes=20 * CHUNK_BYTES, clock=clock)
    done, kept = keys(2, "done"), keys(2, "kept")
    store_chunks(store, done)
    store_chunks(store, kept, priority=90, retain_s=60.0)
    store.flush(5.0)
    store.set_priority(done, 0)  # the session ended: release its prefix
    assert store.tiers[0].policy.order()[:2] == done[::-1]
    store_chunks(store, keys(2, "new"))
    store.flush(5.0)
    assert store.lookup(done) == ["disk", "disk"] and store.lookup(kept) == ["arena"] * 2
    store.set_priority(kept, 90, retain_s=60.0)
    for n in range(6):  # push the kept chunks out of a 4-slot arena with retained others
        store_chunks(store, keys(1, f"hot{n}"), priority=100)
        store.flush(5.0)
    assert store.lookup(kept) == ["disk", "disk"]
    assert load(store, kept).tiers == ["disk", "disk"]  # promoted back...
    assert store.index.policy.retention(kept[0]) == (90, 1060.0)  # ...with its retention
    entry = store.index.entries[kept[0]]
    assert store.index.lasting_priority(entry) == DEFAULT_PRIORITY  # headers: no timed one
    store.check_integrity()


def test_keep_stronger_never_lowers_and_a_release_does(tmp_path: Path,
                                                      make_store: MakeStore) -> None:
    """Scenario: requests finishing on one shared prefix, in the arena and on disk: a
    shorter or lower retention leaves the stronger one; an equal priority with a later
    deadline extends it; a plain set (a release) lowers."""
    clock = Clock()
    store = make_store(tmp_path, slots=4, disk_bytes=20 * CHUNK_BYTES, clock=clock)
    chain = keys(2)
    store_chunks(store, chain)
    store.flush(5.0)
    store.set_priority(chain, 80, 60.0, keep_stronger=True)
    for priority, retain_s in ((80, 5.0), (50, None), (DEFAULT_PRIORITY, None)):
        store.set_priority(chain, priority, retain_s, keep_stronger=True)
        assert store.index.policy.retention(chain[0]) == (80, 1060.0)
        assert store.tiers[0].policy.retention(chain[1]) == (80, 1060.0)
    store.set_priority(chain, 80, 100.0, keep_stronger=True)
    assert store.index.policy.retention(chain[1]) == (80, 1100.0)
    store.set_priority(chain, 90, 1.0, keep_stronger=True)  # higher wins, however short
    assert store.tiers[0].policy.retention(chain[0]) == (90, 1001.0)
    store.set_priority(chain, 0)
    assert store.index.policy.retention(chain[0]) == (0, None)
    assert store.tiers[0].policy.retention(chain[1]) == (0, None)
    store.check_integrity()


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, 1e12, True])
def test_bad_durations_are_refused_before_anything_changes(tmp_path: Path,
                                                           make_store: MakeStore,
                                                           bad: object) -> None:
    store = make_store(tmp_path, slots=3)
    k = keys(1)
    with pytest.raises(InvalidRequest, match="duration_s must be"):
        store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS, priority=80,
                      retain_s=bad)  # type: ignore[arg-type]
    assert store.arena.free_slots == 3
    store_chunks(store, k)
    with pytest.raises(InvalidRequest, match="duration_s must be"):
        store.set_priority(k, 80, retain_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match=r"priority must be in \[0, 100\]"):
        store.set_priority(k, 101, retain_s=5.0)
    assert store.index.policy.retention(k[0]) == (DEFAULT_PRIORITY, None)
    store.check_integrity()


def test_retention_is_seen_in_metrics(tmp_path: Path, make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(tmp_path, slots=3, disk_bytes=20 * CHUNK_BYTES, clock=clock)
    kept, other = keys(2, "kept"), keys(1, "other")
    store_chunks(store, kept, priority=90, retain_s=30.0)
    store_chunks(store, other)
    store.flush(5.0)
    store_chunks(store, keys(1, "tick"))  # a commit sets the gauges
    assert sample(store, "kvtier_retained_chunks", tier="arena", band="80-100") == 2
    assert sample(store, "kvtier_retained_bytes", tier="arena", band="80-100") == 2 * SLOT_BYTES
    assert sample(store, "kvtier_retained_chunks", tier="disk", band="80-100") == 2
    assert sample(store, "kvtier_retained_bytes", tier="disk", band="80-100") == 2 * CHUNK_BYTES
    assert load(store, kept).tiers == ["arena", "arena"]
    assert load(store, [keys(1, "tick")[0]]).tiers == ["arena"]
    assert sample(store, "kvtier_retained_hits_total", tier="arena", retained="yes") == 2
    assert sample(store, "kvtier_retained_hits_total", tier="arena", retained="no") == 1
    clock.now += 31.0
    store_chunks(store, keys(1, "after"))  # a victim is chosen: the deadlines are read
    store.flush(5.0)
    store.set_priority(other, 0)
    assert sample(store, "kvtier_retention_expiries_total", tier="arena") == 2
    assert sample(store, "kvtier_retention_releases_total") == 1
    assert sample(store, "kvtier_retained_chunks", tier="arena", band="80-100") == 0
    assert sample(store, "kvtier_retained_chunks", tier="disk", band="0-34") == 1


def test_expiries_show_in_metrics_without_any_eviction(tmp_path: Path,
                                                       make_store: MakeStore) -> None:
    """Scenario: a quiet store (nothing stored, nothing evicted) after a retention ended:
    the housekeeping tick applies the deadlines, so the gauges and expiries are current."""
    clock = Clock()
    store = make_store(tmp_path, slots=8, disk_bytes=20 * CHUNK_BYTES, clock=clock)
    kept = keys(3, "kept")
    store_chunks(store, kept, priority=90, retain_s=30.0)
    store.flush(5.0)
    store.housekeeping()
    assert sample(store, "kvtier_retained_chunks", tier="arena", band="80-100") == 3
    clock.now += 31.0
    store.housekeeping()
    for tier in ("arena", "disk"):
        assert sample(store, "kvtier_retained_chunks", tier=tier, band="80-100") == 0
        assert sample(store, "kvtier_retained_chunks", tier=tier, band="35") == 3
        assert sample(store, "kvtier_retention_expiries_total", tier=tier) == 3
    store.check_integrity()
