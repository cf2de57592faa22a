"""Random workloads against a tiny store: the books balance after every step.

A state machine reserves, writes, commits, aborts, leases, releases, expires and drops owners
over twelve keys, with an arena of six slots above a disk tier of eight chunks: with
write-through, with write-back (freeing slots ahead) and with write-back behind an admission
rule. After every step:

- ``check_integrity()`` passes, the arena holds at most its slots, the disk at most its bytes;
- a key is only ever served once it was committed, and always with exactly its bytes;
- a slot under a lease still holds its chunk's bytes when the lease is released;
- a lease grants what the lookup just before it promised (one predicate for both);
- a call that names one key twice is refused whole, and changes nothing.

At the end the store is closed, its disk folder must hold exactly the chunks it indexed, and
a new store rebuilt from that folder serves the same bytes.

Lower-tier I/O runs on the store's threads, so a run is timing dependent: hypothesis may
report a failure as "flaky" (it did not replay); the store's own error is inside that report.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from store_helpers import (
    CHUNK_BYTES,
    NS,
    PAYLOAD,
    TOKENS,
    build_store,
    disk_files,
    expected,
    keys,
    load,
    pattern,
    sample,
)

from kvtier.codec import HEADER_SIZE
from kvtier.errors import InvalidRequest
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.store.records import ItemState, Where

SLOTS = 6
DISK_BYTES = 8 * CHUNK_BYTES
TTL = 10.0
KEYS = keys(12, "prop")
OWNERS = (1, 2)

picks = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)  # repeats included
choices = st.lists(st.integers(0, 63), min_size=1, max_size=4)


@dataclass
class Reservation:
    owner: int
    deadline: float


@dataclass
class HeldLease:
    owner: int
    deadline: float
    items: list[tuple[ChunkKey, int]]
    """(key, slot) of each chunk the lease holds."""


class StoreMachine(RuleBasedStateMachine):
    write_policy = "through"
    admission: dict[str, int] | None = None
    free_target = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvtier-property-"))
        self.now = 0.0
        self.store = self.open_store()
        self.committed: set[ChunkKey] = set()
        self.reserved: dict[ChunkKey, Reservation] = {}
        self.held: dict[int, HeldLease] = {}

    def open_store(self) -> TieredStore:
        return build_store(self.root, slots=SLOTS, disk_bytes=DISK_BYTES,
                           write_policy=self.write_policy, admission=self.admission,
                           clock=lambda: self.now, lease_ttl_s=TTL,
                           free_target=self.free_target, disk_options={"fsync": False})

    # ------------------------------------------------------------------ the two-phase store

    @rule(chosen=picks, owner=st.sampled_from(OWNERS))
    def reserve(self, chosen: list[ChunkKey], owner: int) -> None:
        """Reserve and write the payloads; the commit (or abort) comes in a later step."""
        self.reserve_keys(chosen, owner)

    @rule(chosen=picks, owner=st.sampled_from(OWNERS), settle=st.booleans())
    def store_chunks(self, chosen: list[ChunkKey], owner: int, settle: bool) -> None:
        self.commit_keys(self.reserve_keys(chosen, owner))
        if settle:  # else the next steps race the write-through copies
            assert self.store.flush()

    def refused(self, call: Callable[[], object], chosen: list[ChunkKey]) -> bool:
        """A call naming a key twice raises InvalidRequest and leaves everything as it was."""
        if len(set(chosen)) == len(chosen):
            return False
        before = self.snapshot()
        with pytest.raises(InvalidRequest, match="repeats"):
            call()
        assert self.snapshot() == before
        self.store.check_integrity()
        return True

    def snapshot(self) -> tuple[object, ...]:
        store = self.store
        return (store.arena.free_slots, list(store.arena.leases), len(store.leases),
                sorted(store.reservations), len(store.policy))

    def reserve_keys(self, chosen: list[ChunkKey], owner: int) -> list[ChunkKey]:
        if self.refused(lambda: self.store.reserve(owner, NS, chosen, payload_len=PAYLOAD,
                                                   tokens=TOKENS), chosen):
            return []
        slots = self.store.reserve(owner, NS, chosen, payload_len=PAYLOAD, tokens=TOKENS)
        assert len(slots) == len(chosen)
        granted = []
        for key, slot in zip(chosen, slots, strict=True):
            if key in self.reserved:
                assert slot is None, "a key reserved by a client is never handed out twice"
            if slot is not None:
                self.store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD] = pattern(key)
                self.reserved[key] = Reservation(owner, self.now + TTL)
                granted.append(key)
        return granted

    @rule(choice=choices)
    def commit(self, choice: list[int]) -> None:
        self.commit_keys(self.pick(choice, sorted(self.reserved)))

    def commit_keys(self, chosen: list[ChunkKey]) -> None:
        if self.refused(lambda: self.store.commit(chosen), chosen):
            return
        mine = [key for key in chosen if key in self.reserved]
        assert self.store.commit(chosen) == len(mine)
        for key in mine:
            del self.reserved[key]
            self.committed.add(key)

    @rule(choice=choices)
    def abort(self, choice: list[int]) -> None:
        chosen = self.pick(choice, sorted(self.reserved))
        if self.refused(lambda: self.store.abort(chosen), chosen):
            return
        mine = [key for key in chosen if key in self.reserved]
        assert self.store.abort(chosen) == len(mine)
        for key in mine:
            del self.reserved[key]

    # ------------------------------------------------------------------ the two-phase load

    @rule(choice=choices, owner=st.sampled_from(OWNERS), hold=st.booleans())
    def lease(self, choice: list[int], owner: int, hold: bool) -> None:
        chosen = self.pick(choice, [key for key in KEYS if self.store.lookup([key])])
        if self.refused(lambda: self.store.lookup(chosen), chosen):
            assert self.refused(lambda: self.store.lease(owner, chosen), chosen)
            return
        tiers = self.store.lookup(chosen)
        assert set(tiers) <= {"arena", "disk"}
        assert all(key in self.committed for key in chosen[: len(tiers)])
        no_slot = sample(self.store, "kvtier_store_refusals_total", reason="arena_full_promote")
        record = self.store.lease(owner, chosen)
        assert [item.key for item in record.items] == chosen[: len(record.items)]
        if sample(self.store, "kvtier_store_refusals_total",
                  reason="arena_full_promote") == no_slot:
            assert len(record.items) == len(tiers), "the lease grants what lookup promised"
        assert self.store.wait(record.lease_id, 10.0).done
        ready: list[tuple[ChunkKey, int]] = []
        for item in record.items:
            assert item.key in self.committed, "only committed chunks are ever served"
            assert item.key not in self.reserved, "nor one being written again"
            assert item.state is ItemState.READY, f"a load from {item.tier} failed"
            self.check_bytes(item.key, item.slot)
            ready.append((item.key, item.slot))
        if hold:
            self.held[record.lease_id] = HeldLease(owner, self.now + TTL, ready)
        else:
            self.store.release(record.lease_id)

    @rule(choice=st.integers(0, 7))
    def release(self, choice: int) -> None:
        if not self.held:
            return
        lease_id = sorted(self.held)[choice % len(self.held)]
        for key, slot in self.held.pop(lease_id).items:
            self.check_bytes(key, slot)  # nothing reused the slot while it was leased
        self.store.release(lease_id)

    @staticmethod
    def pick(choice: list[int], likely: list[ChunkKey]) -> list[ChunkKey]:
        """Keys by index: mostly from ``likely`` (reserved, or present), some from all keys.

        Draws have the same shape whatever the store's state, which background I/O makes
        timing dependent; only what they mean varies.
        """
        chosen = [likely[i % len(likely)] if likely and i % 4 else KEYS[i % len(KEYS)]
                  for i in choice]
        return chosen  # a key may repeat: such calls must be refused whole

    def check_bytes(self, key: ChunkKey, slot: int) -> None:
        got = self.store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD].tobytes()
        assert got == expected([key])[0]

    # ------------------------------------------------------------------ time and owners

    @rule(seconds=st.sampled_from([1.0, TTL / 2, TTL]))
    def expire(self, seconds: float) -> None:
        self.now += seconds
        self.store.expire()
        self.held = {i: h for i, h in self.held.items() if h.deadline > self.now}
        self.reserved = {k: r for k, r in self.reserved.items() if r.deadline > self.now}

    @rule(owner=st.sampled_from(OWNERS))
    def drop_owner(self, owner: int) -> None:
        self.store.drop_owner(owner)
        self.held = {i: h for i, h in self.held.items() if h.owner != owner}
        self.reserved = {k: r for k, r in self.reserved.items() if r.owner != owner}

    @rule()
    def flush(self) -> None:
        assert self.store.flush()

    # ------------------------------------------------------------------ after every step

    @invariant()
    def books_balance(self) -> None:
        store = self.store
        store.check_integrity()
        assert store.arena.num_slots - store.arena.free_slots <= SLOTS
        disk = store.tiers[0]
        assert disk.used <= disk.capacity and disk.used + disk.reserved <= disk.capacity
        assert set(store.leases) == set(self.held), "leases live until released or expired"
        assert {k for k, e in store.entries.items() if e.where is Where.RESERVED} \
            == set(self.reserved)
        for held in self.held.values():
            for key, slot in held.items:
                assert store.arena.leases[slot] >= 1
                self.check_bytes(key, slot)

    def teardown(self) -> None:
        try:
            self.restart_serves_the_same_bytes()
        finally:
            self.store.close(drain_s=5)
            shutil.rmtree(self.root, ignore_errors=True)

    def restart_serves_the_same_bytes(self) -> None:
        self.store.close(drain_s=5)  # drains writes and the deletes queued behind them
        indexed = set(self.store.tiers[0].sizes)
        files = disk_files(self.root)
        on_disk, listed = set(files), {key.hex() for key in indexed}
        assert on_disk == listed, f"files not indexed: {on_disk - listed}, lost: {listed - on_disk}"
        assert sum(path.stat().st_size for path in files.values()) <= DISK_BYTES
        self.store = self.open_store()
        assert self.store.rebuild() == len(indexed)
        for key in indexed:
            assert load(self.store, [key]) == (["disk"], expected([key]))
        self.store.check_integrity()


class WriteBackMachine(StoreMachine):
    write_policy = "back"
    free_target = 0.34


class WriteBackAfterUsesMachine(StoreMachine):
    write_policy = "back"
    admission = {"after_uses": 2}


PROPERTY = settings(max_examples=50, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestWriteThrough = StoreMachine.TestCase
TestWriteThrough.settings = PROPERTY
TestWriteBack = WriteBackMachine.TestCase
TestWriteBack.settings = PROPERTY
TestWriteBackAfterUses = WriteBackAfterUsesMachine.TestCase
TestWriteBackAfterUses.settings = PROPERTY
