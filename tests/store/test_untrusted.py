"""The hostile peer: a writer of the shared tier who puts whatever it likes there.

Two servers (TieredStores, each with an arena of its own) share one tier — a folder,
redis-server or SeaweedFS S3 — and a third party writes notes and chunks straight through the
tier's own client. Each story ends with nothing wrong served, both servers still serving, and
the books passing their integrity check (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    PAYLOAD,
    SLOT_BYTES,
    TOKENS,
    arena_name,
    expected,
    keys,
    load,
    pattern,
    sample,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.auth import Keyring
from kvtier.codec import HEADER_SIZE, seal, stored_size, verify
from kvtier.config import ServerConfig
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore, journal
from kvtier.store.sweeper import SERVERS, sweeper_of
from kvtier.tiers.shared import MAX_NOTE_BYTES, SharedTier

FAST = {"journal_interval_s": 0.05, "poll_s": 0.1, "sweep_interval_s": 0.3,
        "journal_keep_s": 5.0}
OLD, NEW = b"old cluster secret 0123456789", b"new cluster secret 9876543210"

Servers = Callable[..., TieredStore]


def _fs(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    return {"type": "fs", "options": {"path": str(tmp_path / "volume"), "fsync": False}}


def _redis(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    redis = request.getfixturevalue("redis_server")
    return {"type": "redis", "options": {"url": redis.url}}


def _s3(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    from tiers.s3_helpers import key_file

    bucket = request.getfixturevalue("s3_bucket")
    keys_path = key_file(tmp_path / "keys", bucket.credentials)
    return {"type": "s3", "options": {"bucket": bucket.name, "endpoint_url": bucket.endpoint,
                                      "tls": False, "credentials": f"file:{keys_path}"}}


BACKENDS = [pytest.param(_fs, id="fs"),
            pytest.param(_redis, id="redis", marks=pytest.mark.services),
            pytest.param(_s3, id="s3", marks=pytest.mark.services)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The shared tier's type and options (its service outlives the servers on it)."""
    made: dict[str, Any] = request.param(tmp_path, request)
    return made


@pytest.fixture
def servers(backend: dict[str, Any], tmp_path: Path) -> Iterator[Servers]:
    """``servers(name, secrets=None, **sharing options)``: a store on the shared tier."""
    made: list[TieredStore] = []

    def make(name: str, secrets: list[bytes] | None = None, *, slots: int = 8,
             capacity: int = 64 * CHUNK_BYTES, io_timeout_s: float = 30.0,
             **options: Any) -> TieredStore:
        tier = {**backend, "name": "shared", "capacity_bytes": capacity, "io_threads": 2,
                "io_timeout_s": io_timeout_s,
                "options": {**backend["options"], **FAST, **options}}
        store = open_store(tmp_path, name, tier, secrets or [], slots=slots)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close(drain_s=5)


def open_store(tmp_path: Path, name: str, tier: dict[str, Any], secrets: Sequence[bytes], *,
               slots: int = 8) -> TieredStore:
    """A store named ``name`` on ``tier`` holding ``secrets`` (from an environment variable of
    its own, gone once the store has read it), rebuilt from the tier."""
    env = f"KVTIER_TEST_SECRET_{name.upper()}"
    config = ServerConfig.from_dict({
        "socket_path": str(tmp_path / f"{name}.sock"),
        "arena": {"size_bytes": slots * SLOT_BYTES, "slot_bytes": SLOT_BYTES,
                  "free_target": 0.0},
        "tiers": [tier], "orphan_grace_s": 0.0,
        "auth": {"shared_secret_env": env}})
    os.environ[env] = ",".join(s.decode() for s in secrets)
    try:
        store = TieredStore(config, arena_name=arena_name(),
                            instance=name.encode().hex().ljust(16, "0"))
    finally:
        del os.environ[env]
    store.rebuild()
    return store


def tier_of(store: TieredStore) -> SharedTier:
    tier = store.tiers[0].tier
    assert isinstance(tier, SharedTier)
    return tier


def listed(store: TieredStore) -> set[ChunkKey]:
    return {c.key for c in tier_of(store).scan()}


def put_journal(store: TieredStore, records: list[list[Any]], *, server: str = "e" * 16,
                ms: int | None = None, data: bytes | None = None) -> str:
    """A note from a peer that is no kvtier server: raw msgpack records."""
    ms = int(time.time() * 1000) if ms is None else ms
    name = journal.note_name(ms, server, 0)
    tier_of(store).put_note(name, data if data is not None else
                            msgspec.msgpack.encode(records))
    return name


def rejected(store: TieredStore, what: str) -> int:
    sharing = store.sharing[store.tiers[0].name]
    return sharing.rejected.get(what, 0)


def forged_chunk(key: ChunkKey, payload: bytes, keyring: Keyring | None = None) -> memoryview:
    """A chunk of the right key and namespace with payload chosen by the writer, sealed with
    fresh checksums (and a MAC, given a keyring)."""
    buf = memoryview(bytearray(stored_size(len(payload))))
    buf[HEADER_SIZE:HEADER_SIZE + len(payload)] = payload
    seal(buf, NS, key, TOKENS, len(payload), keyring=keyring)
    return buf


# ---------------------------------------------------------------------- the journal

def test_a_forged_journal_size_cannot_wipe_the_tier(servers: Servers) -> None:
    a, b = servers("a"), servers("b")
    held = keys(6, "held")
    store_chunks(a, held)
    settle(a)
    assert wait_until(lambda: all(k in b.tiers[0] for k in held), 5.0)
    ghost, used = keys(1, "ghost")[0], b.tiers[0].used
    put_journal(a, [["+", NS, ghost, 2**60], ["+", NS, ghost, 1], ["+", b"short", ghost, 8192],
                    "not a record", ["?", NS, ghost, 8192]])
    assert wait_until(lambda: rejected(b, "journal_record") >= 5, 5.0)
    assert ghost not in b.tiers[0] and b.tiers[0].used == used
    store_chunks(b, keys(2, "more"))  # a write that, with a 2**60-byte chunk booked, ...
    settle(b)
    time.sleep(0.3)  # ... would evict and delete every older chunk, journaling it to a
    assert set(held) <= listed(a), "nothing already stored is lost"
    assert load(b, held).payloads == expected(held)
    assert sample(b, "kvtier_untrusted_total", tier="shared", what="journal_record") >= 5
    a.check_integrity()
    b.check_integrity()


def test_oversized_and_overfull_notes_are_dropped_whole(servers: Servers) -> None:
    a, b = servers("a"), servers("b")
    phantom = keys(journal.MAX_RECORDS + 1, "phantom")
    size = b.tiers[0].fits_slot  # a size a chunk here may have: only the count is wrong
    put_journal(a, [["+", NS, k, size] for k in phantom], server="e" * 16)
    put_journal(a, [], server="f" * 16, data=os.urandom(MAX_NOTE_BYTES + 1))
    assert wait_until(lambda: rejected(b, "note_too_large") == 1, 5.0)
    assert wait_until(lambda: rejected(b, "journal_record") == len(phantom), 5.0)
    assert not any(k in b.tiers[0] for k in phantom), "not one record of either applied"
    real = keys(3, "real")  # and the journal still works
    store_chunks(a, real)
    settle(a)
    assert wait_until(lambda: b.lookup(real) == ["shared"] * 3, 5.0)
    b.check_integrity()


def test_a_full_note_is_applied_in_short_lock_holds(servers: Servers) -> None:
    roomy = 2 * (journal.MAX_RECORDS + 8) * CHUNK_BYTES  # room for every booking (Redis: 1.3x)
    a, b = servers("a", capacity=roomy), servers("b", capacity=roomy)
    many = keys(journal.MAX_RECORDS, "many")
    b.lock_max_s.clear()
    put_journal(a, [["+", NS, k, b.tiers[0].fits_slot] for k in many])
    assert wait_until(lambda: all(k in b.tiers[0] for k in many[-3:]), 10.0)
    assert sum(k in b.tiers[0] for k in many) == len(many)
    b.check_integrity()


def test_a_future_heartbeat_wins_nothing_and_is_swept(servers: Servers) -> None:
    a = servers("a")
    tier = tier_of(a)
    forged = f"{SERVERS}0000"  # the smallest id: it would win every election
    tier.put_note(forged, msgspec.msgpack.encode({"t": 1e12}))
    tier.put_note(f"{SERVERS}0001", b"\xc1 not msgpack")
    future = put_journal(a, [], ms=int(time.time() * 1000) + 3_600_000)
    odd = "journal/not-a-journal-name"
    tier.put_note(odd, b"")
    assert wait_until(lambda: sweeper_of(tier, time.time()) == a.instance, 5.0), \
        "the live server sweeps, not the forged clock"
    gone = {forged, f"{SERVERS}0001", future, odd}
    assert wait_until(lambda: not gone & set(tier.list_notes("servers/")
                                             + tier.list_notes(journal.PREFIX)), 5.0)
    sharing = a.sharing[a.tiers[0].name]
    assert sharing._cursor_ms <= time.time() * 1000, \
        "the future note (read or swept first) never moved the journal cursor ahead"
    a.check_integrity()


# ---------------------------------------------------------------------- the cluster secret

def test_a_chunk_resealed_without_the_secret_is_never_served(servers: Servers) -> None:
    a, b = servers("a", [OLD]), servers("b", [OLD])
    k = keys(2, "sealed")
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 5.0)
    assert load(b, k).payloads == expected(k), "signed chunks load on another server"
    b2 = servers("b2", [OLD])
    assert wait_until(lambda: b2.lookup(k) == ["shared"] * 2, 5.0)
    evil = bytes(PAYLOAD)
    tier_of(a).write(k[1], forged_chunk(k[1], evil))  # fresh checksums, no MAC
    got = load(b2, k)
    assert got.payloads[0] == expected(k)[0] and got.payloads[1:] in ([], [None])
    assert sample(b2, "kvtier_untrusted_total", tier="shared", what="chunk_mac") == 1
    assert sample(b2, "kvtier_checksum_failures_total", tier="shared") == 1
    b2.check_integrity()


def test_forged_chunks_are_said_once_per_tier_and_each_counted(
        servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """A peer without the secret may write thousands: one WARNING for the tier, then only
    the counter (and DEBUG lines)."""
    a = servers("a", [OLD])
    chains = [keys(1, f"forged-{i}") for i in range(3)]
    for k in chains:
        store_chunks(a, k)
    settle(a)
    for k in chains:
        tier_of(a).write(k[0], forged_chunk(k[0], bytes(PAYLOAD)))
    b = servers("b", [OLD])
    assert wait_until(lambda: all(b.lookup(k) == ["shared"] for k in chains), 5.0)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        for k in chains:
            assert load(b, k).payloads in ([], [None]), "never served"
    assert sample(b, "kvtier_untrusted_total", tier="shared", what="chunk_mac") == 3
    said = [r for r in caplog.records if r.levelno >= logging.WARNING and "MAC" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    b.check_integrity()


def test_notes_without_the_secret_are_ignored(servers: Servers) -> None:
    a, b = servers("a", [OLD]), servers("b", [OLD])
    ghost = keys(1, "ghost")
    put_journal(a, [["+", NS, ghost[0], b.tiers[0].fits_slot]])
    assert wait_until(lambda: rejected(b, "note_unsigned") >= 1, 5.0)
    assert ghost[0] not in b.tiers[0]
    k = keys(2, "signed")  # the signed journal still flows
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 5.0)


def test_rotation_accepts_every_listed_secret_and_signs_with_the_first(
        servers: Servers) -> None:
    new_first, old_only = servers("n", [NEW, OLD]), servers("o", [OLD])
    both = servers("x", [OLD, NEW])
    k = keys(2, "rotated")
    store_chunks(new_first, k)
    settle(new_first)
    assert wait_until(lambda: both.lookup(k) == ["shared"] * 2, 5.0)
    assert load(both, k).payloads == expected(k)
    assert load(old_only, k).payloads in ([], [None], [None, None]), \
        "a server that lacks the new secret trusts nothing it signed"
    assert wait_until(lambda: rejected(old_only, "note_unsigned") >= 1, 5.0)


def test_a_server_without_a_secret_reads_signed_chunks_as_before(servers: Servers) -> None:
    a, b = servers("a", [OLD]), servers("b")
    k = keys(2, "plain")
    store_chunks(a, k)
    settle(a)
    assert set(k) <= listed(b)
    view = memoryview(bytearray(SLOT_BYTES))
    got = tier_of(b).read_into(k[0], view, namespace=NS)
    assert got is not None
    assert verify(view[:got], k[0], NS).tokens == TOKENS
    assert bytes(view[HEADER_SIZE:HEADER_SIZE + PAYLOAD]) == pattern(k[0]).tobytes()


# ---------------------------------------------------------------------- a stuck sweep

def test_a_sweep_stuck_on_one_io_does_not_stop_sweeping(servers: Servers) -> None:
    a = servers("a", sweep_interval_s=0.2, io_timeout_s=1.0)
    tier = tier_of(a)
    release = threading.Event()
    calls: list[float] = []
    real = tier.namespaces

    def hanging() -> list[bytes]:
        calls.append(time.monotonic())
        if len(calls) == 1:
            release.wait(30.0)  # a hung mount: the first sweep never comes back (until freed)
        return real()

    tier.namespaces = hanging  # type: ignore[method-assign]
    try:
        assert wait_until(lambda: len(calls) >= 2, 10.0), "a later sweep ran beside the stuck one"
    finally:
        release.set()
    assert np.all(np.diff(calls) > 0)
    a.check_integrity()


def test_a_listing_that_breaks_on_garbage_does_not_stop_a_start(
        backend: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.store.breaker import BreakerState
    from kvtier.tiers import TIERS

    cls = TIERS[backend["type"]]

    def broken(self: SharedTier) -> Iterator[Any]:
        raise ValueError("invalid literal for int() with base 10: b'\\xff'")
        yield  # a generator, as the tiers' scans are

    monkeypatch.setattr(cls, "scan", broken)
    config = ServerConfig.from_dict({
        "socket_path": str(tmp_path / "s.sock"),
        "arena": {"size_bytes": 4 * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "tiers": [{**backend, "name": "shared", "capacity_bytes": 1 << 20,
                   "options": {**backend["options"], **FAST}}]})
    store = TieredStore(config, arena_name=arena_name(), keyring=None)
    try:
        assert store.rebuild() == 0, "the server starts; the tier's books start empty"
        assert store.tiers[0].breaker.state is not BreakerState.CLOSED
        k = keys(1, "arena")
        store_chunks(store, k)
        assert load(store, k).payloads == expected(k), "and it serves from the arena"
        store.check_integrity()
    finally:
        store.close(drain_s=5)
