"""Signed notes belong to one tier: the replaying peer.

Two shared tiers of one cluster (two folders, two Redis key prefixes, two S3 prefixes), both
signed with the same cluster secret. A peer that can read one and write the other copies the
signed journal notes and heartbeats of tier X into tier Y under their own names. Each story ends
with tier Y's chunks still served and the books passing their integrity check
(docs/security.md, "The cluster secret").
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    expected,
    keys,
    load,
    sample,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.admin import _journal as admin_journal
from kvtier.auth import Keyring, NoteRefusal, Why
from kvtier.store import TieredStore, journal
from kvtier.store.sweeper import SERVERS, sweeper_of
from kvtier.tiers.shared import SharedTier
from store.test_untrusted import listed, open_store, tier_of

FAST = {"journal_interval_s": 0.05, "poll_s": 0.1, "sweep_interval_s": 0.3,
        "journal_keep_s": 5.0}
SECRET = b"one cluster secret 0123456789"

Tiers = Callable[[str], dict[str, Any]]
"""The options of tier ``x`` or ``y`` of one backend."""
Servers = Callable[..., TieredStore]


def _fs(tmp_path: Path, request: pytest.FixtureRequest) -> Tiers:
    return lambda which: {"type": "fs", "options": {"path": str(tmp_path / f"volume-{which}"),
                                                    "fsync": False}}


def _redis(tmp_path: Path, request: pytest.FixtureRequest) -> Tiers:
    url = request.getfixturevalue("redis_server").url
    return lambda which: {"type": "redis", "options": {"url": url,
                                                       "key_prefix": f"kv{which}:"}}


def _s3(tmp_path: Path, request: pytest.FixtureRequest) -> Tiers:
    from tiers.s3_helpers import key_file

    bucket = request.getfixturevalue("s3_bucket")
    keys_path = key_file(tmp_path / "keys", bucket.credentials)
    return lambda which: {"type": "s3", "options": {
        "bucket": bucket.name, "endpoint_url": bucket.endpoint, "tls": False,
        "credentials": f"file:{keys_path}", "prefix": f"kv{which}/"}}


@pytest.fixture(params=[pytest.param(_fs, id="fs"),
                        pytest.param(_redis, id="redis", marks=pytest.mark.services),
                        pytest.param(_s3, id="s3", marks=pytest.mark.services)])
def tiers(request: pytest.FixtureRequest, tmp_path: Path) -> Tiers:
    made: Tiers = request.param(tmp_path, request)
    return made


@pytest.fixture
def servers(tiers: Tiers, tmp_path: Path) -> Iterator[Servers]:
    """``servers(name, which, capacity=..., **options)``: a store with the secret on tier
    ``which`` (``x`` or ``y``)."""
    made: list[TieredStore] = []

    def make(name: str, which: str, *, capacity: int = 64 * CHUNK_BYTES,
             secrets: tuple[bytes, ...] = (SECRET,), **options: Any) -> TieredStore:
        backend = tiers(which)
        tier = {**backend, "name": "shared", "capacity_bytes": capacity, "io_threads": 2,
                "io_timeout_s": 30.0, "options": {**backend["options"], **FAST, **options}}
        store = open_store(tmp_path, name, tier, secrets)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close(drain_s=5)


def rejected(store: TieredStore, what: str) -> int:
    return store.sharing[store.tiers[0].name].rejected.get(what, 0)


def copy_notes(src: SharedTier, dst: SharedTier, prefix: str) -> int:
    """What the replaying peer does: every note under ``prefix`` of ``src`` written into
    ``dst`` under the same name, byte for byte."""
    copied = 0
    for name in src.list_notes(prefix):
        data = src.get_note(name)
        if data is not None:
            dst.put_note(name, data)
            copied += 1
    return copied


def test_signed_notes_copied_from_another_tier_are_refused(
        servers: Servers, caplog: pytest.LogCaptureFixture) -> None:
    """Tier Y holds 6 chunks of its 10; tier X's journal books 8 more. Applied in Y, they
    would make Y's next writes evict Y's own, real chunks for chunks Y does not hold."""
    caplog.set_level(logging.WARNING, logger="kvtier.store")
    a = servers("a", "x", capacity=10 * CHUNK_BYTES)
    b = servers("b", "y", capacity=10 * CHUNK_BYTES)
    held, theirs = keys(6, "held in y"), keys(8, "held in x")
    store_chunks(b, held)
    settle(b)
    store_chunks(a, theirs)
    settle(a)
    assert wait_until(lambda: len(tier_of(a).list_notes(journal.PREFIX)) >= 1, 5.0)
    time.sleep(0.2)  # every record of a's writes is in a note
    assert copy_notes(tier_of(a), tier_of(b), journal.PREFIX) >= 1
    assert wait_until(lambda: rejected(b, "note_other_tier") >= 1
                      or any(k in b.tiers[0] for k in theirs), 5.0)
    time.sleep(0.3)  # b polls again: still nothing of x's
    booked = [k for k in theirs if k in b.tiers[0]]
    store_chunks(b, keys(1, "more in y"))  # fits: 7 of 10, nothing evicted
    settle(b)
    time.sleep(0.2)
    assert set(held) <= listed(b), "y's own chunks stay in y"
    assert booked == [], "x's chunks are not booked in y"
    assert sample(b, "kvtier_untrusted_total", tier="shared", what="note_other_tier") >= 1
    said = [r.getMessage() for r in caplog.records if "signed for the tier" in r.getMessage()]
    assert len(said) == 1 and tier_of(a).note_scope in said[0], said
    a.check_integrity()
    b.check_integrity()


def test_a_heartbeat_copied_from_another_tier_wins_no_election(servers: Servers) -> None:
    """A copied heartbeat of a server with the smallest id would make Y's servers wait for
    a sweeper that is not there (namespace budgets never enforced)."""
    a = servers("0", "x")  # the smallest id of all
    b = servers("b", "y")
    assert wait_until(lambda: sweeper_of(tier_of(a), time.time(), a.keyring) is not None, 5.0)
    assert copy_notes(tier_of(a), tier_of(b), SERVERS) >= 1
    now = time.time()
    assert wait_until(lambda: sweeper_of(tier_of(b), time.time(), b.keyring) is not None, 5.0)
    assert sweeper_of(tier_of(b), now, b.keyring) == b.instance
    b.check_integrity()


def test_one_tier_id_lets_servers_that_mount_the_tier_at_different_paths_share(
        tmp_path: Path, servers: Servers, tiers: Tiers) -> None:
    """The default scope of an fs tier is its path: mounted elsewhere on one node, notes are
    refused (and said so); the same ``tier_id`` everywhere joins them."""
    if tiers("x")["type"] != "fs":
        pytest.skip("only an fs path can differ between the servers of one tier")
    volume = Path(tiers("x")["options"]["path"])
    volume.mkdir()
    (tmp_path / "elsewhere").symlink_to(volume)
    a = servers("a", "x")
    b = servers("b", "x", path=str(tmp_path / "elsewhere"))
    k = keys(2, "one tier, two paths")
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: rejected(b, "note_other_tier") >= 1, 5.0)
    assert not any(key in b.tiers[0] for key in k), "one path's notes are not the other's"
    c = servers("c", "x", tier_id="team-a-nfs")
    d = servers("d", "x", path=str(tmp_path / "elsewhere"), tier_id="team-a-nfs")
    k = keys(2, "one tier id")
    store_chunks(c, k)
    settle(c)
    assert wait_until(lambda: d.lookup(k) == ["shared"] * 2, 5.0)
    assert load(d, k).payloads == expected(k)
    c.check_integrity()
    d.check_integrity()


def _old_format(name: str, data: bytes) -> bytes:
    """A note as a kvtier before tier-bound notes signed it (name and bytes only)."""
    key_id = hmac.new(SECRET, b"kvtier key id v1", hashlib.sha256).digest()[:8]
    key = hmac.new(SECRET, b"kvtier note MAC v1", hashlib.sha256).digest()
    mac = hmac.new(key, name.encode() + b"\0" + data, hashlib.sha256).digest()
    return b"KVTN" + key_id + mac + data


def test_notes_of_the_previous_version_are_refused_and_counted(servers: Servers) -> None:
    """A rolling upgrade: what an older server journals is not applied here (it could have
    been copied from any tier), and says so once."""
    b = servers("b", "y")
    ghost = keys(1, "old server's write")[0]
    name = journal.note_name(int(time.time() * 1000), "f" * 16, 0)
    data = journal.encode([journal.Record("+", NS, ghost, b.tiers[0].fits_slot)])
    tier_of(b).put_note(name, _old_format(name, data))
    assert wait_until(lambda: rejected(b, "note_old_format") >= 1, 5.0)
    assert ghost not in b.tiers[0]
    b.check_integrity()


def test_the_scope_is_bound_by_the_mac_not_by_what_the_note_says() -> None:
    """A peer without the secret rewriting a note's scope gets a forgery, not a copy."""
    ring = Keyring.from_secrets([SECRET])
    signed = ring.sign_note("s3:bucket/x/", "journal/1", b"records")
    assert ring.open_note("s3:bucket/x/", "journal/1", signed) == b"records"
    assert ring.open_note("s3:bucket/y/", "journal/1", signed) == NoteRefusal(
        Why.OTHER_TIER, "s3:bucket/x/")
    relabelled = signed.replace(b"s3:bucket/x/", b"s3:bucket/y/")
    assert ring.open_note("s3:bucket/y/", "journal/1", relabelled) == NoteRefusal(Why.UNSIGNED)
    assert ring.open_note("s3:bucket/x/", "journal/2", signed) == NoteRefusal(Why.UNSIGNED)
    other = Keyring.from_secrets([b"another cluster 0123456789"])
    assert other.open_note("s3:bucket/x/", "journal/1", signed) == NoteRefusal(Why.UNSIGNED)


def test_the_notes_kvtier_rm_writes_are_signed_for_the_tier(servers: Servers) -> None:
    """``kvtier rm`` and ``kvtier gc`` journal their deletes as a server would: signed for
    the tier, so running servers forget what went within a poll."""
    a, b = servers("a", "y"), servers("b", "y")
    k = keys(2, "removed by rm")
    store_chunks(a, k)
    settle(a)
    assert wait_until(lambda: b.lookup(k) == ["shared"] * 2, 5.0)
    gone = [c for c in tier_of(a).scan() if c.key in k]
    for chunk in gone:
        tier_of(a).delete(chunk.key, namespace=chunk.namespace)
    admin_journal(tier_of(a), gone, keyring=a.keyring)
    assert wait_until(lambda: not any(key in b.tiers[0] for key in k), 5.0)
    assert rejected(b, "note_unsigned") == rejected(b, "note_other_tier") == 0
    b.check_integrity()
