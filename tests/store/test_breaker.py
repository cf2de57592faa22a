"""The circuit breaker of a lower tier, against real faults: a filesystem that turns
read-only, a tier folder that is replaced by a file, a tier made slow, a tier that hangs.

Where delay or a hang is added, a real disk tier is wrapped (the test names say so); the
read-only filesystem and the folder are real. Nobody runs the server's housekeeping thread
here, so the tests call ``store.housekeeping()`` where the server would.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    CHUNK_BYTES,
    MakeStore,
    expected,
    keys,
    load,
    remount,
    sample,
    settle,
    small_filesystem,
    store_chunks,
    wait_until,
)

from kvtier.errors import TierIOError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.breaker import BreakerState
from kvtier.store.records import ItemState
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.disk import DiskTier

BREAKER = {"errors": 3, "error_ratio": 0.5, "window_s": 30, "cooldown_s": 0.2,
           "latency_budget_s": 1.0}


def disk_store(make_store: MakeStore, root: Path, path: Path, *, slots: int = 4,
               **tier: Any) -> TieredStore:
    config = {"type": "disk", "name": "disk", "capacity_bytes": 64 * CHUNK_BYTES,
              "io_threads": 1, "breaker": BREAKER,
              "options": {"path": str(path), "fsync": False}, **tier}
    return make_store(root, slots=slots, tiers=[config])


def breaker(store: TieredStore) -> BreakerState:
    return store.tiers[0].breaker.state


def evict_all(store: TieredStore, label: str) -> None:
    """Fill the arena with other chunks, so what was there is only below it."""
    store_chunks(store, keys(store.arena.num_slots, label))
    settle(store)


def probe_until_closed(store: TieredStore, timeout_s: float = 5.0) -> bool:
    def closed() -> bool:
        store.housekeeping()
        return breaker(store) is BreakerState.CLOSED
    return wait_until(closed, timeout_s)


def transitions(caplog: pytest.LogCaptureFixture, words: str) -> int:
    return sum(1 for r in caplog.records if words in r.getMessage())


def test_a_read_only_filesystem_opens_the_breaker_and_a_probe_closes_it(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvtier.store")
    with small_filesystem(tmp_path / "mnt", 1 << 20) as mount:
        store = disk_store(make_store, tmp_path, mount / "disk")
        k = keys(1)
        store_chunks(store, k)
        settle(store)
        remount(mount, "ro")
        for i in range(6):
            store_chunks(store, keys(1, f"refused{i}"))
            settle(store)
        assert breaker(store) is BreakerState.OPEN
        assert sample(store, "kvtier_breaker_state", tier="disk") == 2
        assert sample(store, "kvtier_io_errors_total", tier="disk", direction="write") == 3
        assert sample(store, "kvtier_admission_refusals_total", tier="disk",
                      reason="breaker_open") == 3, "writes are not even queued"
        evict_all(store, "while-open")
        assert store.lookup(k) == [], "lookups skip an open tier"
        assert transitions(caplog, "bypassed (circuit breaker open)") == 1
        time.sleep(0.3)
        store.housekeeping()  # the probe fails: still read-only
        assert store.flush() and settle(store) is None
        store.housekeeping()
        assert breaker(store) is not BreakerState.CLOSED
        remount(mount, "rw")
        assert probe_until_closed(store)
        assert transitions(caplog, "back in service") == 1
        assert transitions(caplog, "bypassed") == 1, "one line per change of state"
        assert load(store, k) == (["disk"], expected(k))
        store.check_integrity()


def test_a_tier_folder_replaced_by_a_file_opens_the_breaker_until_it_is_back(
        tmp_path: Path, make_store: MakeStore) -> None:
    path = tmp_path / "tier"
    store = disk_store(make_store, tmp_path, path)
    shutil.rmtree(path)
    path.write_text("not a folder")
    for i in range(4):
        store_chunks(store, keys(1, f"lost{i}"))
        settle(store)
    assert breaker(store) is BreakerState.OPEN
    path.unlink()
    time.sleep(0.3)
    assert probe_until_closed(store)
    k = keys(1, "after")
    store_chunks(store, k)
    settle(store)
    evict_all(store, "later")
    assert load(store, k) == (["disk"], expected(k))
    store.check_integrity()


def test_a_vanished_tier_folder_is_made_again_without_tripping(
        tmp_path: Path, make_store: MakeStore) -> None:
    path = tmp_path / "tier"
    store = disk_store(make_store, tmp_path, path)
    before = keys(2, "before")
    store_chunks(store, before)
    settle(store)
    shutil.rmtree(path)
    after = keys(2, "after")
    store_chunks(store, after)
    settle(store)
    evict_all(store, "evictor")
    assert load(store, after) == (["disk"] * 2, expected(after))
    assert load(store, before).payloads == [None, None], "gone with the folder: a miss"
    assert store.lookup(before) == [], "and forgotten"
    assert breaker(store) is BreakerState.CLOSED
    store.check_integrity()


class DelayedTier(DiskTier):
    """A real disk tier whose reads first wait on ``delay`` (or until ``release`` is set)."""

    delay_s = 0.0
    release: threading.Event | None = None

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        if self.release is not None:
            self.release.wait(30)
        time.sleep(self.delay_s)
        return super().read_into(key, dst, namespace=namespace)


@contextmanager
def wrapped(store: TieredStore, **attrs: Any) -> Iterator[DelayedTier]:
    state = store.tiers[0]
    tier = DelayedTier(state.name, state.config)
    for name, value in attrs.items():
        setattr(tier, name, value)
    real, state.tier = state.tier, tier
    try:
        yield tier
    finally:
        state.tier = real


def test_a_slow_tier_wrapped_with_delay_opens_its_breaker(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = disk_store(make_store, tmp_path, tmp_path / "tier", slots=6,
                       breaker={**BREAKER, "errors": 2, "error_ratio": 0.0,
                                "latency_budget_s": 0.5})
    k = keys(3)
    store_chunks(store, k)
    settle(store)
    evict_all(store, "evictor")
    assert breaker(store) is BreakerState.CLOSED, "the real writes were within the budget"
    with wrapped(store, delay_s=1.0):
        for key in k[:2]:
            assert load(store, [key]) == (["disk"], expected([key])), "slow, but right"
        assert breaker(store) is BreakerState.OPEN
        assert store.lookup(k[2:]) == [], "then bypassed: recompute is faster"
    store.check_integrity()


def test_a_hung_tier_wrapped_to_block_fails_its_waiters_and_keeps_the_slot(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = disk_store(make_store, tmp_path, tmp_path / "tier", slots=6, io_timeout_s=0.3)
    k = keys(1)
    store_chunks(store, k)
    settle(store)
    evict_all(store, "evictor")
    release = threading.Event()
    with wrapped(store, release=release):
        lease = store.lease(1, k)
        stop = threading.Event()
        keeper = threading.Thread(target=lambda: [store.housekeeping() or stop.wait(0.05)
                                                  for _ in iter(stop.is_set, True)])
        keeper.start()
        try:
            start = time.monotonic()
            status = store.wait(lease.lease_id, 10.0)
            assert status.done and time.monotonic() - start < 3.0
            assert [i.state for i in status.items] == [ItemState.FAILED]
            assert sample(store, "kvtier_io_timeouts_total", tier="disk", direction="read") == 1
            assert store.lookup(k) == [], "a read that hangs is not joined again"
            slot = lease.items[0].slot
            assert store.entries[k[0]].slot == slot, "the slot waits for the read to return"
            store.release(lease.lease_id)
            store.check_integrity()
            release.set()
            assert wait_until(lambda: store.promotions.in_flight == 0)
        finally:
            release.set()
            stop.set()
            keeper.join(5)
    assert store.lookup(k) == ["arena"], "the late read still landed, verified"
    assert load(store, k) == (["arena"], expected(k))
    store.check_integrity()


class HungWriteTier(DiskTier):
    """A real disk tier whose writes first wait until ``release`` is set (a hung mount)."""

    release = threading.Event()

    def write(self, key: ChunkKey, data: memoryview) -> int:
        self.release.wait(30)
        return super().write(key, data)


def test_a_tier_whose_writes_hang_wrapped_to_block_opens_the_breaker_on_writes_alone(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = disk_store(make_store, tmp_path, tmp_path / "tier", slots=8, io_timeout_s=0.2)
    state = store.tiers[0]
    real = state.tier
    hung = HungWriteTier(state.name, state.config)
    hung.release = threading.Event()
    state.tier = hung
    try:
        store_chunks(store, keys(6, "hung"))
        assert store.writes.in_flight == 6

        def opened() -> bool:
            store.housekeeping()
            return breaker(store) is BreakerState.OPEN
        assert wait_until(opened, 5.0), "late and abandoned writes count as failures"
        assert sample(store, "kvtier_io_timeouts_total", tier="disk", direction="write") >= 3
        assert wait_until(lambda: (store.housekeeping() or store.writes.in_flight) <= 2)
    finally:
        hung.release.set()
        state.tier = real
    assert store.flush()
    store.check_integrity()


class UnlistableTier(DiskTier):
    """A real disk tier whose listing fails (``broken``) or hangs until ``release`` is set."""

    broken = True
    release: threading.Event | None = None

    def scan(self) -> Iterator[StoredChunk]:
        if self.release is not None:
            self.release.wait(30)
        if self.broken:
            raise TierIOError(f"tier {self.name}: listing failed (test)")
        yield from super().scan()


def restarted_with(make_store: MakeStore, tmp_path: Path, **attrs: Any
                   ) -> tuple[TieredStore, UnlistableTier, list[ChunkKey]]:
    """A tier holding chunks an earlier store wrote, behind a new store whose tier is
    swapped for one that cannot be listed; the new store is not rebuilt yet."""
    path = tmp_path / "tier"
    first = disk_store(make_store, tmp_path / "first", path, io_timeout_s=0.3)
    k = keys(2, "before")
    store_chunks(first, k)
    settle(first)
    store = disk_store(make_store, tmp_path / "second", path, io_timeout_s=0.3)
    state = store.tiers[0]
    tier = UnlistableTier(state.name, state.config)
    for name, value in attrs.items():
        setattr(tier, name, value)
    state.tier = tier
    return store, tier, k


def test_a_store_starts_when_its_tier_cannot_be_listed_wrapped_to_fail(
        tmp_path: Path, make_store: MakeStore) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    store, tier, before = restarted_with(make_store, tmp_path)
    assert store.rebuild() == 0
    assert breaker(store) is BreakerState.OPEN, "bypassed until it answers"
    k = keys(1, "arena")
    store_chunks(store, k)
    assert load(store, k) == (["arena"], expected(k)), "serving goes on from the arena"
    assert store.lookup(before) == []
    tier.broken = False
    time.sleep(0.3)
    assert probe_until_closed(store)
    assert wait_until(lambda: store.housekeeping() or store.lookup(before) == ["disk"] * 2), \
        "listed again once the breaker closed"
    assert load(store, before) == (["disk"] * 2, expected(before))
    store.check_integrity()


def test_a_store_starts_when_its_tier_listing_hangs_wrapped_to_block(
        tmp_path: Path, make_store: MakeStore) -> None:
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    release = threading.Event()
    store, _tier, _before = restarted_with(make_store, tmp_path, release=release)
    try:
        start = time.monotonic()
        assert store.rebuild() == 0
        assert time.monotonic() - start < 3.0, "bounded by io_timeout_s, not the hang"
        assert breaker(store) is BreakerState.OPEN
        k = keys(1, "arena")
        store_chunks(store, k)
        assert load(store, k) == (["arena"], expected(k))
    finally:
        release.set()
    store.check_integrity()
