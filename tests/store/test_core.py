"""TieredStore on its own arena: lookup, the two-phase store and load, leases and their expiry.

The disk tier's stories (write-through, write-back, admission, promotion, corruption, restart)
are in test_scenarios.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import (
    NS,
    PAYLOAD,
    SLOT_BYTES,
    TOKENS,
    MakeStore,
    expected,
    keys,
    load,
    sample,
    settle,
    store_chunks,
)

from kvtier.codec import HEADER_SIZE
from kvtier.errors import InvalidRequest
from kvtier.store.records import ItemState

# ---------------------------------------------------------------------- lookup

def test_lookup_returns_the_longest_available_prefix(tmp_path: Path, make_store: MakeStore
                                                     ) -> None:
    store = make_store(tmp_path)
    k = keys(4)
    store_chunks(store, [k[0], k[1], k[3]])
    assert store.lookup(k) == ["arena", "arena"]
    assert store.lookup([k[3], k[2], k[0]]) == ["arena"]
    assert store.lookup([k[2], k[0]]) == []
    assert store.lookup([]) == []
    assert sample(store, "kvtier_lookup_chunks_total", outcome="hit") == 3
    assert sample(store, "kvtier_lookup_chunks_total", outcome="miss") == 2 + 2 + 2
    store.check_integrity()


def test_a_reserved_chunk_is_invisible_until_committed(tmp_path: Path, make_store: MakeStore
                                                       ) -> None:
    store = make_store(tmp_path)
    k = keys(2)
    slots = store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert None not in slots and slots[0] != slots[1]
    assert store.lookup(k) == []
    assert store.lease(2, k).items == []
    assert store.commit(k[:1]) == 1
    assert store.lookup(k) == ["arena"]
    assert store.commit(k[:1]) == 0, "a second commit publishes nothing"
    assert store.commit(k) == 1
    assert store.lookup(k) == ["arena", "arena"]
    store.check_integrity()


def test_abort_frees_the_slot_and_forgets_the_chunk(tmp_path: Path, make_store: MakeStore
                                                    ) -> None:
    store = make_store(tmp_path, slots=3)
    k = keys(3)
    assert None not in store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert store.arena.free_slots == 0
    assert store.abort(k[:2]) == 2
    assert store.arena.free_slots == 2
    assert store.abort(k[:2]) == 0
    assert store.commit(k) == 1, "only the chunk still reserved is committed"
    assert store.lookup(k) == []
    assert store.lookup(k[2:]) == ["arena"]
    assert set(store.entries) == {k[2]}
    store_chunks(store, k[:2])
    assert store.lookup(k) == ["arena"] * 3
    store.check_integrity()


def test_aborting_a_committed_chunk_changes_nothing(tmp_path: Path, make_store: MakeStore
                                                    ) -> None:
    store = make_store(tmp_path)
    k = keys(1)
    store_chunks(store, k)
    assert store.abort(k) == 0
    assert load(store, k).payloads == expected(k)
    store.check_integrity()


# ---------------------------------------------------------------------- two-phase store

def test_reserving_a_key_already_stored_or_reserved_returns_none(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path)
    k = keys(3)
    store_chunks(store, k[:1])
    first = store.reserve(1, NS, k[1:2], payload_len=PAYLOAD, tokens=TOKENS)
    assert first[0] is not None
    slots = store.reserve(2, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert slots[0] is None and slots[1] is None and slots[2] is not None
    assert sample(store, "kvtier_store_refusals_total", reason="present") == 2
    assert store.arena.free_slots == 6 - 3
    store.check_integrity()


def test_a_full_arena_evicts_its_least_recently_used_chunk(tmp_path: Path,
                                                           make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4)
    k = keys(4)
    store_chunks(store, k)  # committed tail first: the head k0 is the most recent
    load(store, k[:2])  # touched tail first again: k3, then k2 are the least recent
    newcomer = keys(1, "new")
    assert store_chunks(store, newcomer)[0] is not None
    assert store.lookup([k[3]]) == []
    assert [store.lookup([key]) for key in (k[0], k[1], k[2])] == [["arena"]] * 3
    assert sample(store, "kvtier_evictions_total", tier="arena", cause="capacity") == 1
    assert load(store, newcomer).payloads == expected(newcomer)
    store.check_integrity()


def test_a_leased_chunk_is_never_evicted(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4)
    k = keys(4)
    store_chunks(store, k)
    held = store.lease(1, [k[0]])
    for key in k[1:]:
        load(store, [key])  # k0 is the least recently used, but leased
    store_chunks(store, keys(1, "new"))
    assert store.lookup([k[0]]) == ["arena"]
    assert store.lookup([k[1]]) == [], "the next chunk in LRU order went instead"
    slot = held.items[0].slot
    assert store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD].tobytes() \
        == expected(k[:1])[0]
    store.release(held.lease_id)
    store.check_integrity()


def test_reserve_returns_none_while_every_slot_is_leased(tmp_path: Path,
                                                         make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=3)
    k = keys(3)
    store_chunks(store, k)
    held = store.lease(1, k)
    assert len(held.items) == 3
    newcomer = keys(1, "new")
    assert store.reserve(2, NS, newcomer, payload_len=PAYLOAD, tokens=TOKENS) == [None]
    assert sample(store, "kvtier_store_refusals_total", reason="arena_full") == 1
    assert store.lookup(k) == ["arena"] * 3
    store.release(held.lease_id)
    assert store_chunks(store, newcomer)[0] is not None
    store.check_integrity()


def test_reservations_in_flight_are_never_evicted(tmp_path: Path, make_store: MakeStore
                                                  ) -> None:
    store = make_store(tmp_path, slots=2)
    k = keys(2)
    assert None not in store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert store.reserve(2, NS, keys(1, "new"), payload_len=PAYLOAD, tokens=TOKENS) == [None]
    assert store.commit(k) == 2
    store.check_integrity()


def test_lower_priority_chunks_leave_first(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=3)
    k = keys(3)
    store_chunks(store, k[:1], priority=80)
    store_chunks(store, k[1:])
    store_chunks(store, keys(2, "new"))
    assert store.lookup(k[:1]) == ["arena"], "priority 80 outlives older chunks at 35"
    assert store.lookup(k[1:2]) == [] and store.lookup(k[2:]) == []
    store.set_priority(k[:1], 0)
    store_chunks(store, keys(1, "newer"))
    assert store.lookup(k[:1]) == []
    store.check_integrity()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"payload_len": SLOT_BYTES}, f"payload_len {SLOT_BYTES} does not fit"),
    ({"payload_len": 0}, "payload_len 0 does not fit"),
    ({"priority": 101}, "priority must be in \\[0, 100\\], got 101"),
    ({"priority": -1}, "priority must be in \\[0, 100\\], got -1"),
])
def test_reserve_rejects_what_cannot_be_stored(tmp_path: Path, make_store: MakeStore,
                                               kwargs: dict[str, int], message: str) -> None:
    store = make_store(tmp_path)
    k = keys(2)
    store_chunks(store, k[:1])
    args: dict[str, int] = {"payload_len": PAYLOAD, "tokens": TOKENS, **kwargs}
    with pytest.raises(ValueError, match=message):
        store.reserve(1, NS, k[1:], **args)
    assert store.arena.free_slots == 5
    assert load(store, k).payloads == expected(k[:1])
    store.check_integrity()


def test_the_largest_payload_that_fits_a_slot(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path)
    k = keys(1)
    n = store.arena.slot_bytes - HEADER_SIZE
    store_chunks(store, k, n=n)
    assert load(store, k, n=n).payloads == expected(k, n=n)
    store.check_integrity()


# ---------------------------------------------------------------------- two-phase load

def test_lease_pins_slots_until_released(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path)
    k = keys(3)
    store_chunks(store, k[:2])
    first = store.lease(1, k)
    second = store.lease(2, k[:1])
    assert [i.state for i in first.items] == [ItemState.READY] * 2
    assert first.done and first.lease_id != second.lease_id
    slot = first.items[0].slot
    assert int(store.arena.leases[slot]) == 2
    assert sample(store, "kvtier_hits_total", tier="arena") == 3
    assert sample(store, "kvtier_leases_active") == 2
    store.release(first.lease_id)
    assert int(store.arena.leases[slot]) == 1
    with pytest.raises(InvalidRequest, match=f"no open lease {first.lease_id}"):
        store.release(first.lease_id)
    with pytest.raises(InvalidRequest, match="no open lease"):
        store.wait(first.lease_id, 0.0)
    store.release(second.lease_id)
    assert sum(store.arena.leases) == 0
    store.check_integrity()


def test_a_load_returns_what_was_stored(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path)
    k = keys(5)
    store_chunks(store, k[:3], fill=1)
    store_chunks(store, k[3:], fill=2)
    got = load(store, k)
    assert got.tiers == ["arena"] * 5
    assert got.payloads == expected(k[:3], fill=1) + expected(k[3:], fill=2)
    store.check_integrity()


# ---------------------------------------------------------------------- expiry and owners

class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_leases_and_reservations_expire_after_their_ttl(tmp_path: Path, make_store: MakeStore
                                                        ) -> None:
    clock = Clock()
    store = make_store(tmp_path, slots=3, clock=clock, lease_ttl_s=10.0)
    k = keys(3)
    store_chunks(store, k[:1])
    lease = store.lease(1, k[:1])
    renewed = store.lease(1, k[:1])
    assert None not in store.reserve(2, NS, k[1:], payload_len=PAYLOAD, tokens=TOKENS)

    clock.now += 5
    store.expire()
    assert set(store.leases) == {lease.lease_id, renewed.lease_id}
    store.renew(renewed.lease_id)

    clock.now += 5  # past the first lease and the reservations, not the renewed lease
    store.expire()
    assert set(store.leases) == {renewed.lease_id}
    assert store.commit(k[1:]) == 0, "expired reservations cannot be committed"
    assert store.arena.free_slots == 2
    assert int(store.arena.leases[lease.items[0].slot]) == 1
    assert sample(store, "kvtier_leases_expired_total", kind="lease") == 1
    assert sample(store, "kvtier_leases_expired_total", kind="reservation") == 2
    with pytest.raises(InvalidRequest):
        store.release(lease.lease_id)

    clock.now += 5
    store.expire()
    assert len(store.leases) == 0
    assert sum(store.arena.leases) == 0
    store_chunks(store, keys(3, "new"))  # every slot is reusable: k0 was evicted for these
    assert store.lookup(k) == []
    store.check_integrity()


def test_drop_owner_releases_only_that_owners_leases_and_reservations(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path)
    k = keys(3)
    store_chunks(store, k[:1])
    mine = store.lease(1, k[:1])
    theirs = store.lease(2, k[:1])
    store.reserve(1, NS, k[1:2], payload_len=PAYLOAD, tokens=TOKENS)
    store.reserve(2, NS, k[2:3], payload_len=PAYLOAD, tokens=TOKENS)

    store.drop_owner(1)
    assert set(store.leases) == {theirs.lease_id}
    assert int(store.arena.leases[mine.items[0].slot]) == 1
    assert store.commit(k[1:2]) == 0
    assert store.commit(k[2:3]) == 1
    assert store.lookup(k) == ["arena"]
    assert store.lookup(k[2:]) == ["arena"]
    store.release(theirs.lease_id)
    store.check_integrity()


def test_stats_describe_the_arena(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4)
    store_chunks(store, keys(3))
    lease = store.lease(1, keys(1))
    stats = store.stats()
    assert stats["tiers"] == {"arena": {"slots": 4, "free": 1, "ready": 3, "slot_bytes": 8192}}
    assert stats["leases"] == 1 and stats["entries"] == 3
    store.release(lease.lease_id)
    store.check_integrity()


def test_a_chunk_read_back_under_another_namespace_is_not_served(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=1 << 20)
    k = keys(1)
    store_chunks(store, k)
    settle(store)
    store_chunks(store, keys(2, "evictor"))  # now only the disk holds k
    settle(store)
    disk = store.tiers[0]
    disk.namespaces[k[0]] = bytes(32)  # the books say another namespace
    assert store.lookup(k) == ["disk"]
    assert load(store, k).payloads == [None], "the namespace is verified too"
    assert sample(store, "kvtier_checksum_failures_total", tier="disk") == 1
