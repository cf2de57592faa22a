"""What an unlucky or hostile client does to the store, and what a failing tier does.

Regression tests for the defects found when the store was used as a new user would: a key
named twice, a lookup promising what a lease would not grant, clients that go away and come
back, bugs in the middle of an operation, and a disk that fills.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    PAYLOAD,
    TOKENS,
    MakeStore,
    disk_files,
    expected,
    keys,
    load,
    pattern,
    sample,
    settle,
    small_filesystem,
    store_chunks,
    wait_until,
)

from kvtier.codec import HEADER_SIZE
from kvtier.errors import InvalidRequest, TierFull, TierIOError
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.lower import FULL_COOL_DOWN_S, LowerTierState
from kvtier.store.records import ItemState
from kvtier.tiers import Space
from kvtier.tiers.disk import DiskTier


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------- the same key twice

def test_a_lease_naming_one_key_twice_is_refused_and_strands_no_slot(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4)
    k = keys(1)
    store_chunks(store, k)
    with pytest.raises(InvalidRequest, match=r"keys\[1\] repeats keys\[0\]"):
        store.lease(1, [k[0], k[0]])
    assert sum(store.arena.leases) == 0 and len(store.leases) == 0
    store.check_integrity()
    fresh = keys(4, "fresh")  # every slot is usable again: the old chunk is evicted
    assert None not in store.reserve(1, NS, fresh, payload_len=PAYLOAD, tokens=TOKENS)
    store.check_integrity()


@pytest.mark.parametrize("operation", ["lookup", "reserve", "commit", "abort", "set_priority"])
def test_every_keyed_operation_refuses_repeated_keys_whole(
        tmp_path: Path, make_store: MakeStore, operation: str) -> None:
    store = make_store(tmp_path, slots=4)
    k = keys(2)
    slots = store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    twice = [k[0], k[1], k[0]]
    calls = {
        "lookup": lambda: store.lookup(twice),
        "reserve": lambda: store.reserve(2, NS, [*keys(1, "x"), *keys(1, "x")],
                                         payload_len=PAYLOAD, tokens=TOKENS),
        "commit": lambda: store.commit(twice),
        "abort": lambda: store.abort(twice),
        "set_priority": lambda: store.set_priority(twice, 50),
    }
    free = store.arena.free_slots
    with pytest.raises(InvalidRequest, match="must be distinct"):
        calls[operation]()
    assert store.arena.free_slots == free
    assert sorted(store.reservations) == sorted(k), "the reservations are untouched"
    assert store.commit(k) == 2 and None not in slots
    assert load(store, k).payloads == [None, None] or store.lookup(k) == ["arena"] * 2
    store.check_integrity()


# ---------------------------------------------------------------------- one predicate

def test_lookup_and_lease_agree_on_a_disk_chunk_another_client_rewrites(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=8 * CHUNK_BYTES)
    k = keys(1)
    store_chunks(store, k)
    settle(store)
    store_chunks(store, keys(2, "other"))  # k leaves the arena: only the disk holds it
    settle(store)
    assert store.lookup(k) == ["disk"]
    slots = store.reserve(2, NS, k, payload_len=PAYLOAD, tokens=TOKENS)  # another engine
    assert slots[0] is not None
    store.arena.array[slots[0], HEADER_SIZE : HEADER_SIZE + PAYLOAD] = pattern(k[0])
    assert store.lookup(k) == [], "a chunk being written is not available"
    assert store.lease(1, k).items == [], "and the lease agrees"
    assert store.commit(k, owner=2) == 1
    assert store.lookup(k) == ["arena"]
    assert load(store, k) == (["arena"], expected(k))
    store.check_integrity()


# ---------------------------------------------------------------------- owners

def test_housekeeping_ends_only_what_expired_and_only_the_departed_owners(
        tmp_path: Path, make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(tmp_path, slots=64, clock=clock, lease_ttl_s=10.0, orphan_grace_s=2.0)
    mine, theirs = keys(20, "mine"), keys(20, "theirs")
    store_chunks(store, mine[:10])
    assert None not in store.reserve(1, NS, mine[10:], payload_len=PAYLOAD, tokens=TOKENS)
    assert None not in store.reserve(2, NS, theirs, payload_len=PAYLOAD, tokens=TOKENS)
    leases = [store.lease(owner, mine[:10]).lease_id for owner in (1, 2)]
    store.drop_owner(1)
    clock.now += 2.5
    store.expire()
    assert sorted(store.reservations) == sorted(theirs)
    assert list(store.leases) == [leases[1]]
    clock.now += 5.0
    store.wait(leases[1], 0.0, owner=2)  # waiting renews: alive at 7.5 + 10
    clock.now += 5.0  # 12.5: past owner 2's reservations, not its renewed lease
    store.expire()
    assert len(store.reservations) == 0 and list(store.leases) == [leases[1]]
    assert sample(store, "kvtier_leases_expired_total", kind="reservation") == 30
    store.check_integrity()


def test_a_client_back_within_the_grace_keeps_its_leases_and_reservations(
        tmp_path: Path, make_store: MakeStore) -> None:
    clock = Clock()
    store = make_store(tmp_path, clock=clock, lease_ttl_s=10.0, orphan_grace_s=1.0)
    k = keys(2)
    store_chunks(store, k[:1])
    lease = store.lease(1, k[:1])
    assert None not in store.reserve(1, NS, k[1:], payload_len=PAYLOAD, tokens=TOKENS)
    store.drop_owner(1)
    clock.now += 0.5
    store.resume_owner(1)  # reconnected in time
    clock.now += 5.0
    store.expire()
    assert store.commit(k[1:], owner=1) == 1
    store.release(lease.lease_id, owner=1)
    store.check_integrity()


# ---------------------------------------------------------------------- bugs mid-operation

def test_a_failure_in_the_middle_of_a_lease_leaves_nothing_pinned(
        tmp_path: Path, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, slots=6, disk_bytes=16 * CHUNK_BYTES)
    k = keys(4)
    store_chunks(store, k)
    settle(store)
    store_chunks(store, keys(6, "evictor"))  # k now on disk only
    settle(store)
    assert load(store, k[:1]).tiers == ["disk"]  # ... but the head is in the arena again
    real, calls = store.promotions.begin, []

    def failing_begin(*args: object) -> object:
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("injected bug")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store.promotions, "begin", failing_begin)
    with pytest.raises(RuntimeError, match="injected"):
        store.lease(1, k)
    assert sum(store.arena.leases) == 0 and len(store.leases) == 0
    store.check_integrity()
    monkeypatch.undo()
    assert load(store, k) == (["arena", "disk", "disk", "disk"], expected(k))
    store.check_integrity()


def test_a_failure_in_the_middle_of_a_reserve_undoes_the_whole_call(
        tmp_path: Path, make_store: MakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path, slots=6)
    real, added = store.reservations.add, []

    def failing_add(*args: object) -> None:
        added.append(args)
        if len(added) == 3:
            raise RuntimeError("injected bug")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(store.reservations, "add", failing_add)
    with pytest.raises(RuntimeError):
        store.reserve(1, NS, keys(4), payload_len=PAYLOAD, tokens=TOKENS)
    assert store.arena.free_slots == 6 and len(store.reservations) == 0
    store.check_integrity()


# ---------------------------------------------------------------------- a disk that fills

def small_disk_store(make_store: MakeStore, root: Path, mount: Path, slots: int = 4
                     ) -> TieredStore:
    tier = {"type": "disk", "name": "disk", "capacity_bytes": "1GiB",
            "options": {"path": str(mount / "disk"), "fsync": False}}
    store = make_store(root, slots=slots, tiers=[tier])
    store.rebuild()
    return store


def test_a_disk_tier_never_promises_more_than_its_filesystem_holds(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    with small_filesystem(tmp_path / "mnt", 64 * CHUNK_BYTES) as mount:
        caplog.set_level(logging.INFO, "kvtier.store")
        store = small_disk_store(make_store, tmp_path, mount)
        disk = store.tiers[0]
        assert disk.capacity < 64 * CHUNK_BYTES < disk.configured, "learned at start"
        written = keys(200, "fill")
        for i in range(0, len(written), 4):
            store_chunks(store, written[i : i + 4])
            settle(store)
        assert disk.used <= disk.capacity
        assert sample(store, "kvtier_io_errors_total", tier="disk", direction="write") == 0
        newest = written[-8:-4]  # the last four are still in the arena too
        assert load(store, newest) == (["disk"] * 4, expected(newest))
        lowered = [r for r in caplog.records if "capacity lowered" in r.getMessage()]
        assert len(lowered) == 1, "said once, not once per chunk"
        store.check_integrity()


def test_a_filesystem_filled_by_someone_else_shrinks_the_tier_and_says_so_once(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    with small_filesystem(tmp_path / "mnt", 96 * CHUNK_BYTES) as mount:
        store = small_disk_store(make_store, tmp_path, mount)
        disk = store.tiers[0]
        first = keys(8, "first")
        for i in range(0, 8, 4):
            store_chunks(store, first[i : i + 4])
            settle(store)
        assert disk.used == 8 * CHUNK_BYTES
        caplog.set_level(logging.INFO, "kvtier.store")
        hog = mount / "someone-else"
        with open(hog, "wb") as f:  # fill what is left
            while True:
                try:
                    f.write(b"\0" * CHUNK_BYTES)
                    f.flush()
                except OSError:
                    break
        later = keys(40, "later")
        for i in range(0, len(later), 4):
            store_chunks(store, later[i : i + 4])
            settle(store)
        assert disk.capacity <= 8 * CHUNK_BYTES, "lowered to what the filesystem held"
        assert disk.breaker.allows(), "a full disk is room to make, not a broken tier"
        kept = [key for key in later[:-4] if key in disk]
        assert kept, "writes evict older chunks to make room"
        assert load(store, kept[-1:]) == (["disk"], expected(kept[-1:]))
        lowered = [r for r in caplog.records if "capacity lowered" in r.getMessage()]
        assert len(lowered) == 1
        hog.unlink()
        store.housekeeping()  # room again: the next space check gives the capacity back
        assert store.flush() and settle(store) is None
        store.check_integrity()


def test_a_promotion_waits_only_on_its_own_waiters(
        tmp_path: Path, make_store: MakeStore) -> None:
    """A promotion ends by looking at the leases waiting for its key, not at every lease."""
    store = make_store(tmp_path, slots=8, disk_bytes=16 * CHUNK_BYTES)
    k = keys(3)
    store_chunks(store, k)
    settle(store)
    store_chunks(store, keys(8, "evictor"))
    settle(store)
    first = store.lease(1, k[:1])
    second = store.lease(2, k[:2])
    assert store.wait(first.lease_id, 5.0).done and store.wait(second.lease_id, 5.0).done
    assert [i.state for i in second.items] == [ItemState.READY] * 2
    assert int(store.arena.leases[first.items[0].slot]) == 2
    store.release(first.lease_id)
    store.release(second.lease_id)
    store.check_integrity()


def test_lookup_estimates_each_chunks_arrival_from_measured_reads(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=8, disk_bytes=32 * CHUNK_BYTES, io_threads=1)
    k = keys(4)
    store_chunks(store, k)
    settle(store)
    store_chunks(store, keys(8, "evictor"))
    settle(store)
    assert store.lookup_hit(k).arrival_s == [0.0] * 4, "unknown yet: worth a try"
    assert load(store, k[:1]).tiers == ["disk"]  # one read, measured
    per = store.tiers[0].reads.chunk_s(store.clock())
    assert per is not None and per > 0
    hit = store.lookup_hit(k)
    assert hit.tiers == ["arena", "disk", "disk", "disk"]
    assert hit.arrival_s == pytest.approx([0.0, per, 2 * per, 3 * per]), "one reader: in turn"


class RefusesOnceTier(DiskTier):
    """A real disk tier that cannot report free space (like Redis) and refuses its next
    write as full once (Redis at maxmemory with noeviction)."""

    refuse = True

    def space(self) -> Space | None:
        return None

    def write(self, key: ChunkKey, data: memoryview) -> int:
        if self.refuse:
            self.refuse = False
            raise TierFull(f"tier {self.name}: full (test)")
        return super().write(key, data)


def test_one_full_refusal_from_a_tier_without_space_lowers_its_capacity_only_for_a_while(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    store = make_store(tmp_path, disk_bytes=64 * CHUNK_BYTES, clock=lambda: now[0])
    disk = store.tiers[0]
    first = keys(2, "first")
    store_chunks(store, first)
    settle(store)
    disk.tier = RefusesOnceTier(disk.name, disk.config)
    caplog.set_level(logging.INFO, "kvtier.store")
    store_chunks(store, keys(1, "refused"))
    settle(store)
    assert disk.capacity == 2 * CHUNK_BYTES, "held to what it has"
    warned = [r.getMessage() for r in caplog.records if "capacity lowered" in r.getMessage()]
    assert len(warned) == 1 and "filesystem" not in warned[0]
    store.housekeeping()
    assert disk.capacity == 2 * CHUNK_BYTES, "not before the cool-down"
    now[0] += FULL_COOL_DOWN_S
    store.housekeeping()
    assert disk.capacity == 64 * CHUNK_BYTES, "the configured capacity is back"
    later = keys(4, "later")
    store_chunks(store, later)
    settle(store)
    assert all(key in disk for key in [*first, *later]), "nothing evicted for the refusal"
    store.check_integrity()


def test_a_full_tier_is_held_to_its_stored_chunks_not_its_bookings(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Peers' bookings are not known to be on the tier: after a write refused as full
    (ENOSPC, or a backend without ``space()``), the capacity is what this server's chunks
    take, so the next write makes real room (it forgets the bookings and evicts a chunk)."""
    store = make_store(tmp_path, disk_bytes=64 * CHUNK_BYTES)
    disk = store.tiers[0]
    first = keys(2, "first")
    store_chunks(store, first)
    settle(store)
    stored = disk.used
    size = disk.sizes[first[0]]
    with store._lock.held("test"):
        for key in keys(4, "booked"):
            assert disk.book(key, size, NS, "peer") is None
        assert disk.used == stored + 4 * size
        disk.learn_space(None, full=True)
        assert disk.capacity == stored, "held to what is known to be stored"
        disk.learn_space(Space(free=0, total=1 << 40), full=True)
        assert disk.capacity == stored
        room = disk.make_room(size, lambda _k: False)
        assert room is not None and room.forgotten == 4 and len(room.victims) == 1
        disk.release(size)
        for key, namespace in room.victims:
            disk.deleted(key, namespace)
    store.check_integrity()


class FailsDeletesTier(DiskTier):
    """A real disk tier whose next ``fail`` deletes raise (a backend blip)."""

    fail = 2

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        if self.fail:
            self.fail -= 1
            raise TierIOError(f"tier {self.name}: delete failed (test)")
        super().delete(key, namespace=namespace)


def _two_chunk_disk(tmp_path: Path, make_store: MakeStore, tier: type[DiskTier]
                    ) -> tuple[TieredStore, LowerTierState]:
    """A store whose disk tier holds two chunks (a third evicts one) and is a ``tier``."""
    store = make_store(tmp_path, slots=6, disk_bytes=2 * CHUNK_BYTES, io_threads=1)
    disk = store.tiers[0]
    disk.tier = tier(disk.name, disk.config)
    return store, disk


def test_an_evicted_chunk_whose_delete_fails_is_deleted_by_a_later_try(
        tmp_path: Path, make_store: MakeStore) -> None:
    store, disk = _two_chunk_disk(tmp_path, make_store, FailsDeletesTier)
    k = keys(3)
    for key in k:
        store_chunks(store, [key])
        settle(store)
    assert k[0] not in disk, "evicted from the books to make room"
    assert wait_until(lambda: settle(store) is None and k[0].hex() not in disk_files(tmp_path))
    assert sample(store, "kvtier_io_errors_total", tier="disk", direction="delete") == 2
    assert set(disk_files(tmp_path)) == {key.hex() for key in k[1:]}, "nothing leaked"
    store.check_integrity()


class BrokenDeletesTier(DiskTier):
    """A real disk tier whose deletes fail with what no tier should raise (a bug)."""

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        raise ValueError("delete broke (test)")


def test_a_write_whose_victims_delete_breaks_still_applies_its_outcome(
        tmp_path: Path, make_store: MakeStore) -> None:
    """The write job deletes its victims first; a bug there must not lose the write's
    outcome (the entry would stay writing, its room reserved, flush never drained)."""
    store, disk = _two_chunk_disk(tmp_path, make_store, BrokenDeletesTier)
    k = keys(3)
    for key in k:
        store_chunks(store, [key])
        assert store.flush(10.0), "drained: every write's outcome was applied"
    assert k[2] in disk and disk.reserved == 0
    assert not any(entry.writing for entry in store.entries.values())
    store.check_integrity()


def test_writes_and_reads_offered_to_a_closed_pool_give_back_what_they_took(
        tmp_path: Path, make_store: MakeStore) -> None:
    """A commit or a lease that reaches a tier while the store closes (its pool already
    closed) fails its I/O and gives back the room, the writing mark and the slot."""
    store = make_store(tmp_path, slots=6, disk_bytes=10 * CHUNK_BYTES)
    disk = store.tiers[0]
    stored = keys(1, "stored")
    store_chunks(store, stored)
    for key in keys(9, "filler"):  # pushes `stored` out of the arena; the disk keeps it
        store_chunks(store, [key])
        assert store.flush(10.0)
        if stored[0] not in store.entries:
            break
    assert stored[0] not in store.entries and stored[0] in disk
    disk.pool.close(0.0)
    late = keys(1, "late")
    store_chunks(store, late)  # written through: the pool refuses the job
    got = load(store, stored)  # promoted from the disk: the pool refuses the read
    assert got.payloads in ([], [None])
    assert store.flush(5.0), "nothing in flight"
    assert disk.reserved == 0 and late[0] not in disk
    assert not any(entry.writing for entry in store.entries.values())
    store.check_integrity()


def test_one_failing_overdue_callback_does_not_skip_the_rest_of_its_batch(
        caplog: pytest.LogCaptureFixture) -> None:
    """Overdue jobs are already off the pool's queue: a callback not run would leave its
    entry writing and its room reserved for good."""
    from kvtier.store.housekeeping import _call_all

    ran: list[int] = []

    def broken() -> None:
        raise KeyError("bug")

    with caplog.at_level(logging.ERROR, logger="kvtier.store"):
        _call_all([lambda: ran.append(1), broken, lambda: ran.append(3)])
    assert ran == [1, 3]
    assert any("overdue job's callback failed" in r.getMessage() for r in caplog.records)
