"""A lower tier's books announce each change of what the tier holds; the event log and a
shared tier's journal listen, and what came from a peer is never echoed back to the peers.

Real stores on real folders: a disk tier for this server's own changes, an ``fs`` tier on one
folder shared by two stores for a peer's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from store_helpers import (
    CHUNK_BYTES,
    NS,
    MakeStore,
    disk_files,
    keys,
    load,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.keys import ChunkKey
from kvtier.store import TieredStore, journal
from kvtier.store.changes import Change, Origin, TierChange
from kvtier.tiers.shared import SharedTier

FAST = {"journal_interval_s": 0.05, "poll_s": 0.1, "sweep_interval_s": 3600,
        "journal_keep_s": 60.0}


class Recorder:
    """A listener that keeps every change it is told."""

    def __init__(self) -> None:
        self.changes: list[TierChange] = []

    def tier_changed(self, change: TierChange) -> None:
        self.changes.append(change)

    def of(self, key: ChunkKey) -> list[tuple[Change, Origin]]:
        return [(c.change, c.origin) for c in self.changes if c.key == key]


def listen(store: TieredStore, tier: int = 0) -> Recorder:
    recorder = Recorder()
    store.apply("test", lambda: store.tiers[tier].subscribe(recorder))
    return recorder


def tier_events(store: TieredStore, tier: str) -> list[tuple[str, ChunkKey]]:
    events, _next, lost = store.events_since(0, 1 << 16, NS)
    assert not lost
    return [(e.op, e.key) for e in events if e.tier == tier]


def evict_arena(store: TieredStore, label: str) -> None:
    store_chunks(store, keys(store.arena.num_slots, label))
    settle(store)


# ---------------------------------------------------------------------- this server's own

def test_writes_evictions_deletes_losses_and_hits_are_announced_as_made_here(
        tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=4 * CHUNK_BYTES)
    store.rebuild()
    heard = listen(store)
    k = keys(3)
    store_chunks(store, k[:2])
    settle(store)
    assert heard.of(k[0]) == [(Change.ADDED, Origin.HERE)]
    assert {c.size for c in heard.changes} == {CHUNK_BYTES}, "an addition carries its size"
    evict_arena(store, "arena")  # both written through: their slots are dropped, not written
    assert load(store, k[:1]).tiers == ["disk"]
    assert heard.of(k[0])[-1] == (Change.USED, Origin.HERE), "a hit"

    (disk_files(tmp_path)[k[1].hex()]).unlink()  # lost behind the server's back
    assert load(store, k[1:2]).payloads == [None]
    assert heard.of(k[1])[-2:] == [(Change.REMOVED, Origin.HERE), (Change.DELETED, Origin.HERE)]

    before = set(disk_files(tmp_path))
    store_chunks(store, keys(3, "more"))  # the tier is full: older chunks are evicted
    settle(store)
    evicted = {c.key for c in heard.changes if c.change is Change.REMOVED} - {k[1]}
    assert evicted and {key.hex() for key in evicted} <= before
    for key in evicted:
        assert heard.of(key)[-2:] == [(Change.REMOVED, Origin.HERE),
                                      (Change.DELETED, Origin.HERE)], "removed, then deleted"
        assert key.hex() not in disk_files(tmp_path)
    store.check_integrity()


def test_the_event_log_follows_the_tiers_books(tmp_path: Path, make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=2, disk_bytes=2 * CHUNK_BYTES)
    store.rebuild()
    k = keys(3)
    store_chunks(store, k[:2])
    settle(store)
    assert sorted(tier_events(store, "disk")) == sorted([("stored", k[0]), ("stored", k[1])])
    heard = listen(store)
    store_chunks(store, k[2:])  # room for it: the older of the two leaves the disk
    settle(store)
    removed = [c.key for c in heard.changes if c.change is Change.REMOVED]
    assert len(removed) == 1
    assert tier_events(store, "disk")[-2:] == [("removed", removed[0]), ("stored", k[2])]
    store.check_integrity()


def test_a_listing_at_start_is_announced_as_such(tmp_path: Path,
                                                 make_store: MakeStore) -> None:
    first = make_store(tmp_path, slots=2, disk_bytes=4 * CHUNK_BYTES)
    k = keys(2)
    store_chunks(first, k)
    settle(first)
    first.close()
    again = make_store(tmp_path, slots=2, disk_bytes=4 * CHUNK_BYTES)
    heard = listen(again)
    assert again.rebuild() == 2
    assert sorted(heard.of(k[0]) + heard.of(k[1]), key=str) == [(Change.ADDED,
                                                                  Origin.LISTING)] * 2
    assert sorted(tier_events(again, "disk")) == sorted([("stored", k[0]), ("stored", k[1])])


# ---------------------------------------------------------------------- a peer's

def shared_server(make_store: MakeStore, root: Path, folder: Path, name: str,
                  **options: Any) -> TieredStore:
    tier = {"type": "fs", "name": "shared", "capacity_bytes": 64 * CHUNK_BYTES,
            "io_threads": 2, "options": {"path": str(folder), "fsync": False, **FAST,
                                          **options}}
    store = make_store(root / name, slots=4, tiers=[tier])
    store.rebuild()
    return store


def published_by(store: TieredStore) -> list[journal.Line]:
    """Every record ``store`` has put in the shared tier's journal so far."""
    tier = store.tiers[0].tier
    assert isinstance(tier, SharedTier) and store.keyring is None
    out: list[journal.Line] = []
    for name in tier.list_notes(journal.PREFIX):
        parsed = journal.parse_name(name)
        data = tier.get_note(name)
        if parsed is not None and parsed[1] == store.instance and data is not None:
            out += journal.decode(data).records
    return out


def test_what_a_peer_wrote_or_deleted_is_logged_but_never_echoed(
        tmp_path: Path, make_store: MakeStore) -> None:
    folder = tmp_path / "volume"
    a = shared_server(make_store, tmp_path, folder, "a")
    b = shared_server(make_store, tmp_path, folder, "b")
    heard = listen(b)
    theirs, mine = keys(2, "theirs"), keys(1, "mine")
    store_chunks(a, theirs)
    settle(a)
    assert wait_until(lambda: all(key in b.tiers[0] for key in theirs), 5.0)
    assert heard.of(theirs[0]) == [(Change.ADDED, Origin.PEER)]
    assert ("stored", theirs[0]) in tier_events(b, "shared"), "peers' chunks are events too"

    store_chunks(b, mine)  # b's own write is published; a's are not, by b
    settle(b)
    assert wait_until(lambda: any(r[2] == mine[0] for r in published_by(b)), 5.0)
    assert [(r[0], r[2]) for r in published_by(b)] == [("+", mine[0])]

    evict_arena(a, "evictor")
    next((folder / "chunks").rglob(f"{theirs[0].hex()}.kvc")).unlink()
    assert load(a, theirs[:1]).payloads == [None], "a finds it lost: tells the others"
    assert wait_until(lambda: theirs[0] not in b.tiers[0], 5.0)
    assert heard.of(theirs[0])[-1] == (Change.REMOVED, Origin.PEER)
    assert ("removed", theirs[0]) in tier_events(b, "shared")
    assert any((r[0], r[2]) == ("-", theirs[0]) for r in published_by(a))
    time.sleep(0.3)  # a few of b's journal rounds
    assert all(r[2] != theirs[0] for r in published_by(b)), "never echoed back"
    a.check_integrity()
    b.check_integrity()
