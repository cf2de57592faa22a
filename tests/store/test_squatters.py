"""The squatting peer: a writer of the shared tier who puts an entry of another kind where
one of kvtier's own structures belongs — a file, a link or a FIFO in place of a folder
(``tmp/``, ``notes/``, ``notes/journal/``, ``chunks/``, a namespace folder), a string in
place of one of the redis tier's index keys.

Such an entry may cost the tier what it held there, never a server's start, never the tier's
writes for good and never another tier (docs/security.md). Each story runs two real servers
(TieredStores) on one folder or redis-server, with a node-local disk tier beside the shared
one, and ends with the books passing their integrity check.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    SLOT_BYTES,
    arena_name,
    expected,
    keys,
    load,
    settle,
    small_filesystem,
    store_chunks,
    tier_config,
    wait_until,
)

from kvtier.config import ServerConfig
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore
from kvtier.tiers.redis_layout import Layout
from kvtier.tiers.shared import SharedTier

FAST = {"journal_interval_s": 0.05, "poll_s": 0.1, "sweep_interval_s": 0.3,
        "journal_keep_s": 5.0}
Servers = Callable[..., TieredStore]


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    return tmp_path / "volume"


def fs_shared(volume: Path) -> dict[str, Any]:
    return {"type": "fs", "options": {"path": str(volume), "fsync": False}}


@pytest.fixture
def servers(volume: Path, tmp_path: Path) -> Iterator[Callable[..., TieredStore]]:
    """``servers(name, shared=fs)``: a store with a disk tier of its own and the shared
    tier (``{"type": ..., "options": ...}``; the fs folder ``volume`` by default)."""
    made: list[TieredStore] = []

    def make(name: str, backend: dict[str, Any] | None = None) -> TieredStore:
        backend = backend or fs_shared(volume)
        shared = {**backend, "name": "shared", "capacity_bytes": 64 * CHUNK_BYTES,
                  "io_threads": 2, "io_timeout_s": 30.0,
                  "options": {**backend["options"], **FAST}}
        config = ServerConfig.from_dict({
            "socket_path": str(tmp_path / f"{name}.sock"),
            "arena": {"size_bytes": 4 * SLOT_BYTES, "slot_bytes": SLOT_BYTES,
                      "free_target": 0.0},
            "tiers": [tier_config(tmp_path / name, 64 * CHUNK_BYTES), shared],
            "orphan_grace_s": 0.0})
        store = TieredStore(config, arena_name=arena_name(),
                            instance=name.encode().hex().ljust(16, "0"))
        made.append(store)
        store.rebuild()
        return store

    yield make
    for store in made:
        store.close(drain_s=5)


def squat(folder: Path, how: str) -> None:
    """Put an entry of kind ``how`` where the folder ``folder`` was."""
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    elif folder.exists() or folder.is_symlink():
        folder.unlink()
    if how == "file":
        folder.write_bytes(b"not a folder")
    elif how == "link":
        folder.symlink_to("/nonexistent/elsewhere")
    else:
        os.mkfifo(folder)


def on_tier(store: TieredStore) -> set[ChunkKey]:
    tier = store.tiers_by_name["shared"].tier
    assert isinstance(tier, SharedTier)
    return {c.key for c in tier.scan()}


PLACES = ["tmp", "notes", "notes/journal", "chunks", f"chunks/{NS.hex()}"]


@pytest.mark.parametrize("how", ["file", "link", "fifo"])
def test_entries_in_place_of_the_tiers_folders_do_not_stop_a_restart(
        servers: Servers, volume: Path, how: str) -> None:
    a = servers("a")
    before = keys(3, "before")
    store_chunks(a, before)
    settle(a)
    a.close(drain_s=5)
    for place in ("tmp", "notes", "chunks"):
        squat(volume / place, how)
    a = servers("a")  # restarts on the same folders
    b = servers("b")
    after = keys(3, f"after {how}")
    store_chunks(a, after)
    settle(a)
    assert set(after) <= on_tier(a), "the shared tier takes writes again"
    assert a.tiers_by_name["shared"].available and a.tiers_by_name["disk"].available
    assert wait_until(lambda: b.lookup(after) == ["shared"] * 3, 5.0), "the journal flows"
    assert load(b, after).payloads == expected(after)
    a.check_integrity()
    b.check_integrity()


@pytest.mark.parametrize("place", PLACES, ids=[*PLACES[:-1], "chunks/<ns>"])
def test_a_running_server_keeps_its_shared_tier_when_a_folder_is_replaced(
        servers: Servers, volume: Path, place: str) -> None:
    a, b = servers("a"), servers("b")
    store_chunks(a, keys(2, "first"))
    settle(a)
    squat(volume / place, "file")
    written = keys(8, f"after {place}")  # more writes than the breaker forgives failures
    for at in range(0, len(written), 2):
        store_chunks(a, written[at:at + 2])
        settle(a)
    assert a.tiers_by_name["shared"].available, "the tier is not bypassed"
    assert set(written) <= on_tier(a)
    assert wait_until(lambda: b.lookup(written[-2:]) == ["shared"] * 2, 5.0)
    assert (volume / place).is_dir() and not (volume / place).is_symlink()
    a.check_integrity()
    b.check_integrity()


def test_a_volume_a_peer_filled_does_not_stop_a_start(servers: Servers, volume: Path) -> None:
    """The shared volume full (another writer's file): a miss for every write, no refused
    start; the disk tier beside it serves."""
    with small_filesystem(volume, 1 << 20):
        fd = os.open(volume / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while os.write(fd, b"x" * 4096):
                pass
        os.close(fd)
        a = servers("a")
        k = keys(2, "full volume")
        store_chunks(a, k)
        settle(a)
        assert all(key in a.tiers_by_name["disk"] for key in k)
        a.check_integrity()
        a.close(drain_s=5)


def test_the_disk_tier_puts_its_folders_back_too(servers: Servers, tmp_path: Path) -> None:
    a = servers("a")
    a.close(drain_s=5)
    for place in ("tmp", "chunks", "quarantine"):
        squat(tmp_path / "a" / "disk" / place, "file")
    a = servers("a")
    k = keys(2, "disk")
    store_chunks(a, k)
    settle(a)
    assert a.tiers_by_name["disk"].available and all(key in a.tiers_by_name["disk"] for key in k)
    a.check_integrity()


def index_keys(prefix: str, written: list[ChunkKey]) -> list[str]:
    """The redis tier's index keys a write of ``written`` meets: the namespace set, the note
    names and the index and size buckets of their keys (:mod:`kvtier.tiers.redis_layout`)."""
    layout = Layout(prefix)
    buckets = sorted({key.hex()[:2] for key in written})
    return [layout.namespaces, layout.notes,
            *(layout.index(NS.hex(), b) for b in buckets),
            *(layout.sizes(NS.hex(), b) for b in buckets)]


@pytest.mark.services
@pytest.mark.parametrize("restart", [False, True], ids=["running", "restarted"])
def test_strings_in_place_of_the_redis_index_keys_do_not_bypass_the_tier(
        servers: Servers, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        restart: bool) -> None:
    from tiers.redis_helpers import plain

    from kvtier.tiers import redis as redis_tier

    # each write adds its namespace again (a running server does so once a minute)
    monkeypatch.setattr(redis_tier, "NAMESPACE_REFRESH_S", 0.0)
    redis = request.getfixturevalue("redis_server")
    backend = {"type": "redis", "options": {"url": redis.url, "key_prefix": "sq:"}}
    a, b = servers("a", backend), servers("b", backend)
    first = keys(2, "first")
    store_chunks(a, first)
    settle(a)
    if restart:
        a.close(drain_s=5)
    written = keys(8, f"after squatting, restart={restart}")
    squatted = index_keys("sq:", first + written)
    peer = plain(redis)
    for key in squatted:
        peer.set(key, b"not an index")
    if restart:
        a = servers("a", backend)
    for at in range(0, len(written), 2):
        store_chunks(a, written[at:at + 2])
        settle(a)
    assert a.tiers_by_name["shared"].available, "the tier is not bypassed"
    assert set(written) <= on_tier(a)
    assert wait_until(lambda: b.lookup(written[-2:]) == ["shared"] * 2, 5.0), \
        "the journal flows"
    assert load(b, written[-2:]).payloads == expected(written[-2:])
    assert {peer.type(key) for key in index_keys("sq:", written)} <= {b"set", b"zset", b"hash"}
    a.check_integrity()
    b.check_integrity()
