"""Agents that fork: the same prefix asked for by N requests at once (sub-agents spawned
together) is read from the lower tier once and shared, and stored once.

A real disk tier, wrapped to count its reads per key and to hold them until every request has
asked (the test names say so); N threads lease the same chain at the same moment. A failed or
hung read ends every waiter's wait (they recompute), and nothing stays pinned or in flight.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from store_helpers import (
    CHUNK_BYTES,
    PAYLOAD,
    MakeStore,
    expected,
    keys,
    load,
    sample,
    settle,
    store_chunks,
    tier_config,
    wait_until,
)

from kvtier.codec import HEADER_SIZE
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.records import ItemState
from kvtier.tiers.disk import DiskTier

N = 4
CHAIN = 6


class CountingTier(DiskTier):
    """A real disk tier that counts its reads per key and holds each until ``gate`` opens."""

    gate: threading.Event
    reads: Counter[ChunkKey]

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        self.reads[key] += 1
        self.gate.wait(30)
        return super().read_into(key, dst, namespace=namespace)


@contextmanager
def counted(store: TieredStore) -> Iterator[CountingTier]:
    state = store.tiers[0]
    tier = CountingTier(state.name, state.config)
    tier.gate, tier.reads = threading.Event(), Counter()
    real, state.tier = state.tier, tier
    try:
        yield tier
    finally:
        tier.gate.set()
        state.tier = real


def chain_on_disk(tmp_path: Path, make_store: MakeStore, io_timeout_s: float = 30.0
                  ) -> tuple[TieredStore, list[ChunkKey]]:
    """A store whose chain of CHAIN chunks is on disk only (pushed out of the arena)."""
    tier = {**tier_config(tmp_path, 64 * CHUNK_BYTES), "io_threads": 2,
            "io_timeout_s": io_timeout_s}
    store = make_store(tmp_path, slots=CHAIN + 2, tiers=[tier])
    chain = keys(CHAIN, "parent")
    store_chunks(store, chain)
    settle(store)
    store_chunks(store, keys(CHAIN + 2, "other"))
    settle(store)
    assert store.lookup(chain) == ["disk"] * CHAIN
    return store, chain


def together(store: TieredStore, chain: list[ChunkKey], timeout_s: float = 10.0,
             all_leased: Callable[[], None] | None = None,
             ) -> list[tuple[list[ItemState], list[bytes | None], float]]:
    """N owners lease ``chain`` at once, wait, read, release: (states, payloads, waited).
    ``all_leased`` is called once every owner has its lease (however slow the machine)."""
    start = threading.Barrier(N)
    leased = threading.Semaphore(0)
    out: list[tuple[list[ItemState], list[bytes | None], float]] = [([], [], 0.0)] * N

    def one(owner: int) -> None:
        start.wait(10)
        record = store.lease(owner, chain)
        leased.release()
        began = time.monotonic()
        store.wait(record.lease_id, timeout_s)
        waited = time.monotonic() - began
        states = [item.state for item in record.items]
        got = [store.arena.array[i.slot, HEADER_SIZE:HEADER_SIZE + PAYLOAD].tobytes()
               if i.state is ItemState.READY else None for i in record.items]
        store.release(record.lease_id)
        out[owner - 1] = (states, got, waited)

    threads = [threading.Thread(target=one, args=(i + 1,)) for i in range(N)]
    for t in threads:
        t.start()
    if all_leased is not None:
        for _ in range(N):
            assert leased.acquire(timeout=timeout_s), "an owner never got its lease"
        all_leased()
    return_after = time.monotonic() + 2 * timeout_s
    for t in threads:
        t.join(max(0.0, return_after - time.monotonic()))
        assert not t.is_alive(), "a waiter is stuck"
    return out


def test_n_requests_for_one_chain_read_each_chunk_once_and_get_the_same_bytes(
        tmp_path: Path, make_store: MakeStore) -> None:
    store, chain = chain_on_disk(tmp_path, make_store)
    with counted(store) as tier:
        results = together(store, chain, all_leased=tier.gate.set)
    assert tier.reads == Counter({k: 1 for k in chain}), "one read per chunk"
    want = expected(chain)
    for states, got, _ in results:
        assert states == [ItemState.READY] * CHAIN
        assert got == want
    assert sample(store, "kvtier_hits_total", tier="disk") == N * CHAIN
    assert sample(store, "kvtier_bytes_total", tier="disk", direction="read") \
        == CHAIN * CHUNK_BYTES
    assert store.lookup(chain) == ["arena"] * CHAIN
    assert store.promotions.in_flight == 0 and not store.leases.holdings
    store.check_integrity()


def test_a_failed_read_fails_every_waiter_once_and_they_recompute(
        tmp_path: Path, make_store: MakeStore) -> None:
    store, chain = chain_on_disk(tmp_path, make_store)
    broken = 2
    (next((tmp_path / "disk" / "chunks").rglob(f"{chain[broken].hex()}.kvc"))).unlink()
    with counted(store) as tier:
        results = together(store, chain, all_leased=tier.gate.set)
    assert tier.reads[chain[broken]] == 1, "the missing chunk was asked for once"
    for states, got, _ in results:
        assert states[broken] is ItemState.FAILED
        assert [s for i, s in enumerate(states) if i != broken] == [ItemState.READY] * (CHAIN - 1)
        assert got[:broken] == expected(chain)[:broken]
    assert store.lookup(chain) == ["arena"] * broken, "a miss from there on: recomputed"
    store_chunks(store, chain[broken:])  # the first to recompute stores the rest, once
    assert store_chunks(store, chain[broken:], owner=2) == [None] * (CHAIN - broken)
    settle(store)
    assert load(store, chain) == (["arena"] * CHAIN, expected(chain))
    store.check_integrity()


def test_a_hung_read_ends_every_waiters_wait_within_the_timeout(
        tmp_path: Path, make_store: MakeStore) -> None:
    store, chain = chain_on_disk(tmp_path, make_store, io_timeout_s=0.3)
    stop = threading.Event()
    keeper = threading.Thread(target=lambda: [store.housekeeping() or stop.wait(0.05)
                                              for _ in iter(stop.is_set, True)])
    with counted(store) as tier:  # the gate stays shut: every read hangs
        keeper.start()
        try:
            results = together(store, chain, timeout_s=10.0)
        finally:
            tier.gate.set()
            stop.set()
            keeper.join(5)
    for states, _, waited in results:
        assert ItemState.FAILED in states and waited < 5.0
    assert sum(tier.reads.values()) <= CHAIN, "never a second read of a key"
    assert wait_until(lambda: store.promotions.in_flight == 0, 10.0)
    store.check_integrity()


def test_n_requests_computing_one_chain_store_it_once(tmp_path: Path,
                                                       make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=CHAIN + 2, disk_bytes=64 * CHUNK_BYTES)
    chain = keys(CHAIN, "cold")
    start = threading.Barrier(N)
    granted: list[int] = [0] * N

    def one(owner: int) -> None:
        start.wait(10)
        slots = store_chunks(store, chain, owner=owner)
        granted[owner - 1] = sum(s is not None for s in slots)

    threads = [threading.Thread(target=one, args=(i + 1,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    settle(store)
    assert sum(granted) == CHAIN, "each chunk reserved by one request only"
    assert sample(store, "kvtier_bytes_total", tier="disk", direction="write") \
        == CHAIN * CHUNK_BYTES, "and written below once"
    assert load(store, chain) == (["arena"] * CHAIN, expected(chain))
    store.check_integrity()
