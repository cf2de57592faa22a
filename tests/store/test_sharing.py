"""Two servers, one shared tier: what one writes the other finds, what one deletes the other
forgets, and together they keep the tier within its budget.

Each "server" is a TieredStore with an arena of its own, both with an ``fs`` tier on one
folder (the FUSE-volume variants run the same stories on a real shared mount in
tests/tiers/test_fs.py and the end-to-end tests). Journals are fast here (tens of ms).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    SLOT_BYTES,
    MakeStore,
    arena_name,
    expected,
    keys,
    load,
    sample,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.config import ServerConfig
from kvtier.errors import TierIOError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore, journal
from kvtier.store.breaker import BreakerState
from kvtier.store.changes import Origin
from kvtier.store.housekeeping import probe_key, probe_tier
from kvtier.store.iopool import Job
from kvtier.store.records import ItemState
from kvtier.store.sharing import MAX_TO_TOUCH, TOUCH_BATCH, Sharing
from kvtier.store.sweeper import heartbeats, sweep, sweeper_of
from kvtier.tiers.fs import FsTier

FAST = {"journal_interval_s": 0.05, "poll_s": 0.1, "sweep_interval_s": 0.5,
        "journal_keep_s": 5.0}


def server(make_store: MakeStore, root: Path, folder: Path, name: str, *, slots: int = 4,
           capacity: int = 64 * CHUNK_BYTES, **options: Any) -> TieredStore:
    tier = {"type": "fs", "name": "shared", "capacity_bytes": capacity, "io_threads": 2,
            "options": {"path": str(folder), "fsync": False, **FAST, **options}}
    store = make_store(root / name, slots=slots, tiers=[tier])
    store.rebuild()
    return store


def evict_arena(store: TieredStore, label: str) -> None:
    store_chunks(store, keys(store.arena.num_slots, label))
    settle(store)


def listed(folder: Path) -> dict[str, int]:
    """Chunk files on the shared folder, by key hex, with their sizes."""
    found = {}
    for path in (folder / "chunks").rglob("*.kvc"):
        try:
            found[path.name.removesuffix(".kvc")] = path.stat().st_size
        except FileNotFoundError:  # deleted while we looked
            continue
    return found


def test_a_chunk_one_server_stores_is_found_by_the_other(tmp_path: Path,
                                                         make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    k = keys(3)
    store_chunks(a, k)
    settle(a)
    start = time.monotonic()
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 3, 5.0)
    delay = time.monotonic() - start
    assert delay < 2.0, f"found after {delay:.2f} s"
    assert load(b, k) == (["shared"] * 3, expected(k))
    b.check_integrity()


def test_a_deleted_chunk_is_forgotten_everywhere(tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a", capacity=4 * CHUNK_BYTES)
    b = server(make_store, tmp_path, folder, "b", capacity=4 * CHUNK_BYTES)
    old = keys(4, "old")
    store_chunks(a, old)
    settle(a)
    assert wait_until(lambda: b.lookup(old) == ["shared"] * 4, 5.0)
    newer = keys(4, "newer")
    store_chunks(a, newer)  # the tier is full: a evicts the old ones to make room
    settle(a)
    assert set(listed(folder)) == {k.hex() for k in newer}
    assert wait_until(lambda: all(key not in b.tiers[0] for key in old), 5.0)
    assert b.lookup(old[:1]) == []
    b.check_integrity()


def test_two_writers_keep_the_tier_within_its_capacity(tmp_path: Path,
                                                      make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    capacity = 16 * CHUNK_BYTES
    a = server(make_store, tmp_path, folder, "a", capacity=capacity)
    b = server(make_store, tmp_path, folder, "b", capacity=capacity)
    for i in range(12):
        for store, name in ((a, "a"), (b, "b")):
            store_chunks(store, keys(2, f"{name}{i}-"))
        settle(a)
        settle(b)
        # Each learns the other's newest chunks from its journal before the next round, so a
        # writer is blind only to what the other wrote in this round (a loaded machine may take
        # more than one journal interval to get there; that is no overshoot of the design).
        for reader, newest in ((a, keys(2, f"b{i}-")), (b, keys(2, f"a{i}-"))):
            assert wait_until(lambda r=reader, k=newest: r.lookup(k) == ["shared"] * 2, 5.0)
        # Each keeps its own chunks within the budget and only forgets the other's (never
        # deleting them): the sweeper brings the total back within a sweep interval or two.
        assert sum(listed(folder).values()) <= 2 * capacity + 4 * CHUNK_BYTES
        assert wait_until(lambda: sum(listed(folder).values()) <= capacity + 4 * CHUNK_BYTES,
                          5.0)
    assert wait_until(lambda: sum(listed(folder).values()) <= capacity, 5.0)
    newest = keys(2, "b11-")
    assert wait_until(lambda: a.lookup(newest) == ["shared"] * 2, 5.0)
    assert load(a, newest).payloads == expected(newest)
    a.check_integrity()
    b.check_integrity()


def test_the_sweeper_keeps_each_namespace_within_its_budget(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a", capacity=64 * CHUNK_BYTES,
               namespace_bytes=6 * CHUNK_BYTES, slots=8)
    b = server(make_store, tmp_path, folder, "b", capacity=64 * CHUNK_BYTES,
               namespace_bytes=6 * CHUNK_BYTES, slots=8)
    written = keys(12)
    store_chunks(a, written[:6])
    settle(a)
    time.sleep(0.05)  # file times are kernel ticks (~4 ms): a's chunks must be strictly older
    store_chunks(b, written[6:])
    settle(b)
    written_bytes = (sample(a, "kvtier_bytes_total", tier="shared", direction="write")
                     + sample(b, "kvtier_bytes_total", tier="shared", direction="write"))
    assert written_bytes == 12 * CHUNK_BYTES, "writes do not check namespace budgets"
    assert wait_until(lambda: sum(listed(folder).values()) <= 6 * CHUNK_BYTES, 10.0)
    left = set(listed(folder))
    assert {k.hex() for k in written[6:]} >= left, "the oldest went first"
    assert wait_until(lambda: all(key not in b.tiers[0] for key in written[:6]), 5.0)

    def swept() -> float:  # counted once the whole sweep (notes and temps too) is done
        return (sample(a, "kvtier_evictions_total", tier="shared", cause="sweep")
                + sample(b, "kvtier_evictions_total", tier="shared", cause="sweep"))

    assert wait_until(lambda: swept() >= 6, 5.0), swept()


def test_one_server_sweeps(tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    tier = a.tiers[0].tier
    assert isinstance(tier, FsTier)
    assert wait_until(lambda: len(heartbeats(tier)) == 2, 10.0)
    assert sweeper_of(tier, time.time()) == min(a.instance, b.instance)


def test_a_corrupt_shared_chunk_is_a_miss_removed_and_counted(tmp_path: Path,
                                                             make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    k = keys(1)
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"], 5.0)
    path = next((folder / "chunks").rglob(f"{k[0].hex()}.kvc"))
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\xff" * 16)
    record = b.lease(1, k)
    assert b.wait(record.lease_id, 5.0).items[0].state is ItemState.FAILED
    b.release(record.lease_id)
    assert not path.exists(), "removed from the shared volume"
    assert sample(b, "kvtier_checksum_failures_total", tier="shared") == 1
    assert wait_until(lambda: k[0] not in a.tiers[0], 5.0), "and forgotten by the others"
    evict_arena(a, "evictor")
    assert a.lookup(k) == []


def test_a_server_that_fell_behind_lists_the_tier_again(tmp_path: Path,
                                                        make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    sharing = b.sharing["shared"]
    k = keys(2)
    store_chunks(a, k)
    settle(a)
    journal_folder = folder / "notes" / "journal"
    assert wait_until(lambda: journal_folder.exists() and bool(os.listdir(journal_folder)))
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 5.0)
    with b._locked("test"):  # b misses one record, then its journal is gone
        b.tiers[0].forget(k[0], origin=Origin.PEER)
        b.tiers[0].forget(k[1], origin=Origin.PEER)
    for name in os.listdir(journal_folder):  # as if the sweeper deleted them
        os.unlink(folder / "notes" / "journal" / name)
    assert b.lookup(k) == []
    sharing._cursor_ms = 0  # behind by more than journal_keep_s
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 5.0), "found by listing"


def test_kvtier_gc_dry_run_lists_what_a_sweep_would_delete(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a", namespace_bytes=2 * CHUNK_BYTES,
               sweep_interval_s=3600)
    store_chunks(a, keys(4))
    settle(a)
    tier = a.tiers[0].tier
    assert isinstance(tier, FsTier)
    report = sweep(tier, a.tiers[0].configured, dry_run=True)
    assert len(report.deleted) == 3 and report.usage == {NS: 4 * CHUNK_BYTES}
    assert len(listed(folder)) == 4, "a dry run deletes nothing"
    report = sweep(tier, a.tiers[0].configured)
    assert len(listed(folder)) == 1
    kept = ChunkKey(bytes.fromhex(next(iter(listed(folder)))))
    assert kept in keys(4)


def test_the_sweeper_keeps_what_its_books_retain_longest(tmp_path: Path,
                                                        make_store: MakeStore) -> None:
    """Over a namespace's budget, chunks the sweeping server's books hold at a retention
    priority go after every chunk of a lower one, whatever their age; within a priority,
    the oldest first."""
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a", namespace_bytes=2 * CHUNK_BYTES,
               sweep_interval_s=3600, slots=8)
    written = keys(4)
    for key in written:  # oldest first, each strictly older than the next
        store_chunks(a, [key])
        settle(a)
        time.sleep(0.02)
    tier = a.tiers[0].tier
    assert isinstance(tier, FsTier)
    policy = a.tiers[0].books.policy
    a.set_priority(written[:2], 80, 600.0)  # the two oldest
    assert [policy.peek_priority(k) for k in written] == [80, 80, 35, 35]
    report = sweep(tier, a.tiers[0].configured, dry_run=True, priority=policy.peek_priority)
    # to LOW_WATER of 2 chunks: three go, the retained oldest last
    assert [c.key for c in report.deleted] == [written[2], written[3], written[0]]
    assert [c.key for c in sweep(tier, a.tiers[0].configured, dry_run=True).deleted] \
        == written[:3], "without the books: the oldest first"


@pytest.mark.parametrize("ops", [1])
def test_journal_records_survive_garbage(ops: int) -> None:
    from kvtier.store import journal

    good = journal.Record("+", NS, keys(1)[0], 8192)
    assert journal.decode(journal.encode([good])).records == [
        ("+", NS, keys(1)[0], 8192, None, None)]
    assert journal.decode(b"\xc1 not msgpack").records == []
    assert journal.decode(b"\x91\x94\xa1x\xc4\x01a\xc4\x01b\x01") == journal.Decoded([], 1)


class SlowTouchFs(FsTier):
    """A real fs tier whose touches each take ``delay_s`` (a slow backend), counted."""

    delay_s = 0.012
    touched = 0

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        time.sleep(self.delay_s)
        self.touched += 1
        super().touch(key, namespace=namespace)


def sharing_of(store: TieredStore) -> Sharing:
    return store.sharing[store.tiers[0].name]


Slow = TypeVar("Slow", bound=FsTier)


def on_slowed_backend(tmp_path: Path, make_store: MakeStore, slowed: type[Slow],
                      **tier: Any) -> tuple[TieredStore, Slow]:
    """A store on one shared fs tier whose breaker opens on one operation over the default
    budget (2 s), its backend replaced by ``slowed`` (a real fs tier, slowed down)."""
    config = {"type": "fs", "name": "shared", "capacity_bytes": 64 * CHUNK_BYTES,
              "breaker": {"errors": 1, "error_ratio": 0.0, "latency_budget_s": 2.0},
              "options": {"path": str(tmp_path / "volume"), "fsync": False, **FAST}, **tier}
    store = make_store(tmp_path / "a", tiers=[config])
    store.rebuild()
    state = store.tiers[0]
    slow = slowed(state.name, state.config)
    state.tier = sharing_of(store).tier = slow
    return store, slow


def test_backend_touches_are_bounded_and_a_long_batch_is_not_one_slow_operation(
        tmp_path: Path, make_store: MakeStore) -> None:
    # one batch takes 256 x 12 ms: 3 s against a budget of 2 s (the default), a margin for a
    # busy machine pausing any one call
    store, slow = on_slowed_backend(tmp_path, make_store, SlowTouchFs, io_threads=1)
    state = store.tiers[0]
    sharing = sharing_of(store)
    hits = keys(MAX_TO_TOUCH + 5, "hit")
    with store._locked("test"):
        for key in hits:
            state.hit(key, NS, CHUNK_BYTES)
        assert len(sharing._to_touch) == MAX_TO_TOUCH, "the oldest are dropped"
        assert sharing.touches_dropped == 5
        while len(sharing._to_touch) > TOUCH_BATCH:  # one batch
            sharing._to_touch.pop()
    assert wait_until(lambda: slow.touched == TOUCH_BATCH, 20.0)
    settle(store)
    assert state.breaker.state is BreakerState.CLOSED, "each touch is its own operation"


class SlowNotesFs(FsTier):
    """A real fs tier whose note writes each take ``delay_s`` (a slow backend)."""

    delay_s = 0.0

    def put_note(self, name: str, data: bytes) -> None:
        time.sleep(self.delay_s)
        super().put_note(name, data)


def test_the_breaker_judges_a_job_by_its_tier_calls_alone(
        tmp_path: Path, make_store: MakeStore) -> None:
    """A job kept waiting by a long hold of the store lock (a big batch of lookups), or busy
    between its calls of the tier, is not the tier being slow; a slow call of the tier is."""
    store, slow = on_slowed_backend(tmp_path, make_store, SlowNotesFs)
    state = store.tiers[0]
    sharing = sharing_of(store)
    held = threading.Event()

    def hold() -> None:
        with store._locked("test"):
            held.set()
            time.sleep(3.0)

    def beat_then_wait() -> None:
        sharing._heartbeat()
        time.sleep(1.2)  # busy between calls
        sharing.apply("test", lambda: None)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5.0)
    waits = sharing._job("heartbeat", beat_then_wait, object())
    started = time.monotonic()
    waits(Job(waits, None, None, started))
    holder.join()
    assert time.monotonic() - started > 2.0, "the job did wait out the hold"
    assert state.breaker.state is BreakerState.CLOSED, "not the tier's time"
    slow.delay_s = 2.5
    beats = sharing._job("heartbeat", sharing._heartbeat, object())
    beats(Job(beats, None, None, time.monotonic()))
    assert state.breaker.state is BreakerState.OPEN, "a slow note write opens the breaker"


class FlakyNotesFs(FsTier):
    """A real fs tier whose next ``fail`` note reads fail (a backend blip)."""

    fail = 1

    def get_note(self, name: str) -> bytes | None:
        if self.fail and name.startswith(journal.PREFIX):
            self.fail -= 1
            raise TierIOError(f"tier {self.name}: note read failed (test)")
        return super().get_note(name)


def test_a_journal_note_that_failed_to_fetch_is_fetched_again(
        tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    state = b.tiers[0]
    flaky = FlakyNotesFs(state.name, state.config)
    sharing_of(b).tier = flaky
    k = keys(2)
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 3.0), "not skipped forever"
    assert flaky.fail == 0, "the first fetch failed"
    b.check_integrity()


def test_a_note_dated_far_ahead_does_not_blind_the_readers(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    caplog.set_level(logging.WARNING, "kvtier.store")
    ahead = int(time.time() * 1000) + 3_600_000  # a server whose clock is an hour fast
    sharing_of(a).tier.put_note(journal.note_name(ahead, "fa57", 0), journal.encode([]))
    assert wait_until(lambda: sharing_of(b)._seen.get(journal.note_name(ahead, "fa57", 0))
                      is not None, 3.0)
    k = keys(2)
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 3.0), "still reads the others"
    assert sum("ahead of this server's clock" in r.getMessage() for r in caplog.records) == 2, \
        "one warning per reader"


def test_two_servers_probing_one_shared_tier_use_probe_chunks_of_their_own(
        tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = server(make_store, tmp_path, folder, "a")
    b = server(make_store, tmp_path, folder, "b")
    assert probe_key("shared", a.instance) != probe_key("shared", b.instance)
    errors: list[BaseException] = []

    def probe_often(store: TieredStore) -> None:
        try:
            for _ in range(100):
                probe_tier(store.tiers[0], store.instance)
        except Exception as exc:  # recorded for the assert below
            errors.append(exc)

    threads = [threading.Thread(target=probe_often, args=(s,)) for s in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == [], "at once, neither deletes the other's probe under it"


def big_slot_server(root: Path, folder: Path) -> TieredStore:
    """A server with slots twice the tests' size on the shared folder (closed by the caller)."""
    tier = {"type": "fs", "name": "shared", "capacity_bytes": 64 * CHUNK_BYTES,
            "io_threads": 2, "options": {"path": str(folder), "fsync": False, **FAST}}
    config = ServerConfig.from_dict({
        "socket_path": str(root / "big.sock"),
        "arena": {"size_bytes": 4 * 2 * SLOT_BYTES, "slot_bytes": 2 * SLOT_BYTES,
                  "free_target": 0.0},
        "tiers": [tier]})
    store = TieredStore(config, arena_name=arena_name())
    store.rebuild()
    return store


def test_a_chunk_larger_than_this_servers_slot_is_a_miss_not_corruption(
        tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    big = big_slot_server(tmp_path, folder)
    try:
        small = server(make_store, tmp_path, folder, "small")
        k = keys(1, "big")
        store_chunks(big, k, n=SLOT_BYTES + 1000)  # fits only the big server's slots
        settle(big)
        state = small.tiers[0]
        sharing = small.sharing[state.name]
        assert wait_until(lambda: sharing.rejected.get("journal_record") == 1, 3.0), \
            "its journal record is dropped: no slot here can take it"
        assert k[0] not in state and small.lookup(k) == [], "so it is not offered"
        with small._locked("test"):  # books that disagree with the tier: the read decides
            state.index(k[0], CHUNK_BYTES, 35, NS)
        assert small.lookup(k) == ["shared"]
        assert load(small, k).payloads == [None], "a miss"
        small.check_integrity()
        assert sample(small, "kvtier_checksum_failures_total", tier="shared") == 0
        assert k[0].hex() in listed(folder), "never quarantined or deleted"
        settle(small)
        time.sleep(0.3)  # a journal round: nothing told the big server to forget it
        assert big.lookup(k) == ["arena"] and k[0] in big.tiers[0]
        evict_arena(big, "evictor")
        assert load(big, k, n=SLOT_BYTES + 1000) == (["shared"],
                                                     expected(k, n=SLOT_BYTES + 1000))
    finally:
        big.close(drain_s=5)
