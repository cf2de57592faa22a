"""Stories of the store with a disk tier below the arena.

Each test stores chunks, pushes them around (evictions, restarts, a flipped bit on disk) and
checks where they are, what a load returns and that the books still balance.
"""

from __future__ import annotations

import os
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
    stalled,
    store_chunks,
    tier_config,
    wait_until,
)

from kvtier.codec import HEADER_SIZE, verify
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.records import ItemState, Where

DISK = 16 * CHUNK_BYTES


def disk_used(store: TieredStore) -> int:
    return store.tiers[0].used


def push_out(store: TieredStore, label: str = "filler") -> None:
    """Store as many new chunks as the arena has slots: older unleased chunks leave it."""
    store_chunks(store, keys(store.arena.num_slots, label))
    assert store.flush()


# ---------------------------------------------------------------------- write policies

def test_write_through_copies_every_committed_chunk_to_disk(tmp_path: Path,
                                                            make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4, disk_bytes=DISK)
    k = keys(4)
    store_chunks(store, k)
    assert store.flush()
    assert set(disk_files(tmp_path)) == {key.hex() for key in k}
    assert disk_used(store) == 4 * CHUNK_BYTES
    assert store.lookup(k) == ["arena"] * 4

    push_out(store)
    assert store.lookup(k) == ["disk"] * 4
    assert sample(store, "kvtier_bytes_total", tier="disk", direction="write") \
        == 8 * CHUNK_BYTES
    store.check_integrity()


def test_write_back_writes_a_chunk_only_when_it_leaves_the_arena(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=3, disk_bytes=DISK, write_policy="back")
    k = keys(3)
    for key in k:  # one request each: k0 is the least recently used
        store_chunks(store, [key])
    assert store.flush()
    assert disk_files(tmp_path) == {}
    assert disk_used(store) == 0

    newcomer = keys(1, "new")
    assert store_chunks(store, newcomer) == [None], "k0 must be written before its slot frees"
    assert store.flush()
    assert set(disk_files(tmp_path)) == {k[0].hex()}, "one victim for one slot"
    assert store.lookup(k) == ["disk", "arena", "arena"]
    assert store.arena.free_slots == 1
    assert load(store, k[:1]) == (["disk"], expected(k[:1]))
    assert store.lookup(k[:1]) == ["arena"]
    store.check_integrity()


def test_write_back_ahead_keeps_free_target_slots_free(tmp_path: Path, make_store: MakeStore
                                                       ) -> None:
    store = make_store(tmp_path, slots=4, disk_bytes=DISK, write_policy="back",
                       free_target=0.25)
    k = keys(4)
    for key in k:
        store_chunks(store, [key])
    assert store.flush()
    assert store.arena.free_slots == 1
    assert set(disk_files(tmp_path)) == {k[0].hex()}
    newcomer = keys(1, "new")
    assert store_chunks(store, newcomer)[0] is not None, "a slot was free ahead of time"
    assert store.flush()
    assert set(disk_files(tmp_path)) == {k[0].hex(), k[1].hex()}
    assert store.lookup(k) == ["disk", "disk", "arena", "arena"]
    store.check_integrity()


def test_a_slot_written_back_and_through_at_once_waits_for_both(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Two lower tiers: "back" takes chunks leaving the arena, "through" copies a chunk once
    it was offered twice. K is being written back when its second offer starts a copy to
    "through": the slot must outlive both writes."""
    store = make_store(tmp_path, slots=1, tiers=[
        tier_config(tmp_path, DISK, "back", name="back"),
        tier_config(tmp_path, DISK, "through", {"after_uses": 2}, name="through")])
    back, through = store.tiers
    k = keys(1)
    store_chunks(store, k)
    with stalled(through.pool, through.config.io_threads):
        with stalled(back.pool, back.config.io_threads):
            assert store_chunks(store, keys(1, "x")) == [None]  # K leaves: written back first
            assert store_chunks(store, k) == [None]  # offered again: admitted to "through"
            assert store.entries[k[0]].writing == {"back", "through"}
        assert wait_until(lambda: k[0] in back)
        store.check_integrity()
        assert store_chunks(store, keys(1, "y")) == [None], "K's slot is still being read"
    assert store.flush()
    copy = (tmp_path / "through" / "chunks").rglob(f"{k[0].hex()}.kvc")
    verify(memoryview(next(copy).read_bytes()), k[0], NS)  # an intact copy of K
    assert load(store, k) == (["arena"], expected(k))
    store.check_integrity()


def test_after_uses_keeps_one_time_chunks_off_disk(tmp_path: Path, make_store: MakeStore
                                                   ) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=DISK, admission={"after_uses": 2})
    once, twice = keys(1, "once"), keys(1, "twice")
    store_chunks(store, twice)
    store_chunks(store, once)
    store_chunks(store, keys(1, "filler"))  # twice leaves the arena, never written
    store_chunks(store, twice)  # stored a second time: admitted now
    assert store.flush()
    assert set(disk_files(tmp_path)) == {twice[0].hex()}
    refusals = sample(store, "kvtier_admission_refusals_total", tier="disk", reason="policy")
    assert refusals == 3, "twice (1st use), once and the filler were refused"
    push_out(store)
    assert store.lookup(twice) == ["disk"]
    assert store.lookup(once) == []
    store.check_integrity()


def test_after_uses_with_write_back_counts_hits_in_the_arena(tmp_path: Path,
                                                             make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=DISK, write_policy="back",
                       admission={"after_uses": 2})
    hot, cold = keys(1, "hot"), keys(1, "cold")
    store_chunks(store, hot)
    store_chunks(store, cold)
    load(store, hot)
    push_out(store)
    assert set(disk_files(tmp_path)) == {hot[0].hex()}
    assert store.lookup(hot + cold) == ["disk"]
    assert store.lookup(cold) == []
    refusals = sample(store, "kvtier_admission_refusals_total", tier="disk", reason="policy")
    assert refusals == 1, "cold was used once: refused when it left the arena"
    store.check_integrity()


def test_min_prefix_tokens_admits_only_long_enough_prefixes(tmp_path: Path,
                                                            make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=6, disk_bytes=DISK,
                       admission={"min_prefix_tokens": 2 * TOKENS})
    k = keys(4)
    store_chunks(store, k[:3])
    store_chunks(store, k[3:], first_index=3)
    assert store.flush()
    assert set(disk_files(tmp_path)) == {key.hex() for key in k[1:]}
    assert sample(store, "kvtier_admission_refusals_total", tier="disk", reason="policy") == 1
    store.check_integrity()


def test_a_full_disk_evicts_its_least_recently_used_chunks(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=3 * CHUNK_BYTES)
    k = keys(5)
    for key in k:
        store_chunks(store, [key])
        assert store.flush()
    settle(store)
    assert set(disk_files(tmp_path)) == {key.hex() for key in k[2:]}
    assert disk_used(store) == 3 * CHUNK_BYTES
    assert sample(store, "kvtier_evictions_total", tier="disk", cause="capacity") == 2
    assert store.lookup(k[2:]) == ["disk", "arena", "arena"]
    assert store.lookup(k[:2]) == []
    store.check_integrity()


def test_a_chunk_is_not_written_while_its_delete_is_queued(tmp_path: Path,
                                                          make_store: MakeStore) -> None:
    """The disk holds two chunks. X pushes K out of it; K, still in the arena, is offered
    again before K's file is deleted: writing it now could race the delete and lose it."""
    store = make_store(tmp_path, slots=3, disk_bytes=2 * CHUNK_BYTES)
    k, j, x = keys(1), keys(1, "j"), keys(1, "x")
    for chunk in (k, j):
        store_chunks(store, chunk)
        assert store.flush()
    with stalled(store.tiers[0].pool, store.tiers[0].config.io_threads):
        store_chunks(store, x)  # K's delete and X's write are queued
        assert store_chunks(store, k) == [None]
        assert store.entries[k[0]].writing == set(), "no write of K behind its delete"
    settle(store)
    assert set(disk_files(tmp_path)) == {j[0].hex(), x[0].hex()}
    assert store.lookup(k + j + x) == ["arena"] * 3
    store_chunks(store, k)  # offered once more, with the delete done: written again
    settle(store)
    assert set(disk_files(tmp_path)) == {k[0].hex(), x[0].hex()}
    assert set(store.tiers[0].sizes) == set(k + x)
    store.check_integrity()


# ---------------------------------------------------------------------- loads from disk

def on_disk_only(tmp_path: Path, make_store: MakeStore, n: int = 1, **kw: object
                 ) -> tuple[TieredStore, list[ChunkKey]]:
    """A store whose first ``n`` chunks were written through and pushed out of the arena."""
    store = make_store(tmp_path, slots=2, disk_bytes=DISK, **kw)
    k = keys(n)
    store_chunks(store, k)
    assert store.flush()
    push_out(store)
    assert store.lookup(k) == ["disk"] * n
    return store, k


def test_a_disk_hit_is_staged_through_the_arena(tmp_path: Path, make_store: MakeStore) -> None:
    store, k = on_disk_only(tmp_path, make_store, io_threads=1)
    with stalled(store.tiers[0].pool, 1):
        lease = store.lease(1, k)
        assert [(i.tier, i.state) for i in lease.items] == [("disk", ItemState.PENDING)]
        assert not lease.done
        joined = store.lease(2, k)  # a second reader waits for the same promotion
        assert joined.items[0].slot == lease.items[0].slot
        assert store.lookup(k) == ["disk"]
        assert not store.wait(lease.lease_id, 0.05).done
    assert store.wait(lease.lease_id, 5.0).done
    assert lease.items[0].state is ItemState.READY
    assert joined.items[0].state is ItemState.READY
    slot = lease.items[0].slot
    assert int(store.arena.leases[slot]) == 2
    got = store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD].tobytes()
    assert got == expected(k)[0]
    assert store.lookup(k) == ["arena"]
    assert store.entries[k[0]].where is Where.READY
    store.release(lease.lease_id)
    store.release(joined.lease_id)
    assert sample(store, "kvtier_hits_total", tier="disk") == 2
    assert sample(store, "kvtier_bytes_total", tier="disk", direction="read") == CHUNK_BYTES
    assert load(store, k) == ([("arena")], expected(k))
    store.check_integrity()


def test_a_promoted_chunk_is_not_written_to_disk_again(tmp_path: Path,
                                                       make_store: MakeStore) -> None:
    store, k = on_disk_only(tmp_path, make_store, 2)
    written = sample(store, "kvtier_bytes_total", tier="disk", direction="write")
    assert load(store, k).payloads == expected(k)
    push_out(store, "more")
    assert store.lookup(k) == ["disk", "disk"]
    assert sample(store, "kvtier_bytes_total", tier="disk", direction="write") \
        == written + 2 * CHUNK_BYTES, "only the two new fillers were written"
    store.check_integrity()


def flip_payload_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 10)
        f.write(bytes([byte[0] ^ 0xFF]))


def flip_header_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate(path: Path) -> None:
    os.truncate(path, HEADER_SIZE + 100)


@pytest.mark.parametrize("damage", [flip_payload_byte, flip_header_byte, truncate])
def test_a_corrupted_file_is_detected_and_never_served(tmp_path: Path, make_store: MakeStore,
                                                       damage: object) -> None:
    store, k = on_disk_only(tmp_path, make_store)
    path = disk_files(tmp_path)[k[0].hex()]
    damage(path)  # type: ignore[operator]

    lease = store.lease(1, k)
    status = store.wait(lease.lease_id, 5.0)
    assert [(i.state is ItemState.READY, i.state is ItemState.FAILED) for i in status.items] \
        == [(False, True)]
    store.release(lease.lease_id)
    assert not path.exists()
    assert [p.name.split(".kvc")[0] for p in (tmp_path / "disk" / "quarantine").iterdir()] \
        == [k[0].hex()]
    assert store.lookup(k) == []
    assert load(store, k).payloads == []
    assert sample(store, "kvtier_checksum_failures_total", tier="disk") == 1
    assert store.arena.free_slots + len(store.policy) == 2, "the staging slot was given back"
    assert disk_used(store) == 2 * CHUNK_BYTES, "only the two fillers are accounted"

    store_chunks(store, k)  # recomputed and stored again: a fresh, good copy
    assert store.flush()
    push_out(store, "more")
    assert load(store, k) == (["disk"], expected(k))
    store.check_integrity()


# ---------------------------------------------------------------------- restart

def test_a_restart_rebuilds_the_disk_index(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=6, disk_bytes=DISK)
    k = keys(5)
    store_chunks(store, k[:3], fill=7)
    store_chunks(store, k[3:], fill=8)
    assert store.flush()
    used = disk_used(store)
    store.close()

    again = make_store(tmp_path, slots=4, disk_bytes=DISK)
    assert again.rebuild() == 5
    assert again.lookup(k) == ["disk"] * 5
    assert disk_used(again) == used == 5 * CHUNK_BYTES
    got = load(again, k)
    assert got.tiers == ["disk"] * 4, "four slots: the fifth waits for the next lease"
    assert got.payloads == expected(k[:3], fill=7) + expected(k[3:4], fill=8)
    assert load(again, k[4:]).payloads == expected(k[4:], fill=8)
    assert again.stats()["tiers"]["disk"]["chunks"] == 5  # type: ignore[index]
    again.check_integrity()


def test_a_restart_with_a_smaller_disk_keeps_the_newest_chunks(tmp_path: Path,
                                                               make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=6, disk_bytes=DISK)
    k = keys(5)
    store_chunks(store, k)
    assert store.flush()
    store.close()
    files = disk_files(tmp_path)
    for age, key in enumerate(reversed(k)):  # k0 is the oldest file
        os.utime(files[key.hex()], (1_700_000_000 - 60 * age,) * 2)

    again = make_store(tmp_path, slots=4, disk_bytes=3 * CHUNK_BYTES)
    assert again.rebuild() == 3
    assert again.lookup(k[2:]) == ["disk"] * 3
    assert again.lookup(k[:2]) == []
    assert disk_used(again) == 3 * CHUNK_BYTES
    settle(again)
    assert set(disk_files(tmp_path)) == {key.hex() for key in k[2:]}
    store_chunks(again, keys(1, "new"))
    assert again.flush()
    settle(again)
    assert again.lookup(k[2:3]) == [], "k2, the oldest kept, is the next to go"
    again.check_integrity()


def test_a_restart_skips_damaged_and_foreign_files(tmp_path: Path, make_store: MakeStore
                                                   ) -> None:
    store = make_store(tmp_path, slots=4, disk_bytes=DISK)
    k = keys(3)
    store_chunks(store, k)
    assert store.flush()
    store.close()
    files = disk_files(tmp_path)
    flip_header_byte(files[k[0].hex()])
    (tmp_path / "disk" / "chunks" / "not-a-chunk").write_bytes(b"x")

    again = make_store(tmp_path, slots=4, disk_bytes=DISK)
    assert again.rebuild() == 2
    assert again.lookup(k) == []
    assert again.lookup(k[1:]) == ["disk", "disk"]
    assert load(again, k[1:]).payloads == expected(k[1:])
    assert len(list((tmp_path / "disk" / "quarantine").iterdir())) == 2
    again.check_integrity()


def test_reserving_a_chunk_held_only_on_disk(tmp_path: Path, make_store: MakeStore) -> None:
    store, k = on_disk_only(tmp_path, make_store)
    slots = store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert slots[0] is not None
    store.arena.array[slots[0], HEADER_SIZE : HEADER_SIZE + PAYLOAD] = pattern(k[0])
    assert store.commit(k) == 1
    assert store.lookup(k) == ["arena"]
    assert load(store, k).payloads == expected(k)
    store.check_integrity()
