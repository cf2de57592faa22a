"""``kvtier ls`` / ``gc`` / ``rm`` against a local and a shared tier written by a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from store_helpers import CHUNK_BYTES, NS, SLOT_BYTES, arena_name, keys, settle, store_chunks

from kvtier import admin
from kvtier.cli import main
from kvtier.config import ServerConfig
from kvtier.server import NodeServer
from kvtier.store import TieredStore, journal
from kvtier.tiers.fs import FsTier


def config_file(root: Path, **shared: object) -> Path:
    data = {
        "socket_path": str(root / "sock" / "kvtier.sock"),
        "arena": {"size_bytes": 8 * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "tiers": [
            {"type": "disk", "name": "disk", "capacity_bytes": 64 * CHUNK_BYTES,
             "options": {"path": str(root / "disk"), "fsync": False}},
            {"type": "fs", "name": "shared", "capacity_bytes": 64 * CHUNK_BYTES,
             "options": {"path": str(root / "shared"), "fsync": False,
                         "sweep_interval_s": 3600, **shared}},
        ],
    }
    path = root / "server.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def filled(root: Path, count: int, **shared: object) -> Path:
    path = config_file(root, **shared)
    store = TieredStore(ServerConfig.from_yaml(path), arena_name=arena_name())
    try:
        for i in range(0, count, 4):
            store_chunks(store, keys(4, f"c{i}"))
            settle(store)
    finally:
        store.close(drain_s=5)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_ls_lists_each_tier_by_namespace(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    path = filled(tmp_path, 8)
    rows = run(capsys, "ls", "--config", str(path), "--json")
    assert isinstance(rows, list)
    by_tier = {r["tier"]: r for r in rows}
    assert by_tier["disk"]["chunks"] == 8 and by_tier["shared"]["chunks"] == 8
    assert by_tier["shared"]["shared"] and not by_tier["disk"]["shared"]
    assert by_tier["shared"]["namespace"] == NS.hex()
    assert by_tier["disk"]["bytes"] == 8 * CHUNK_BYTES
    assert main(["ls", "--config", str(path)]) == 0
    table = capsys.readouterr().out
    assert "shared" in table and NS.hex()[:16] in table


def test_gc_sweeps_shared_tiers_to_their_budget(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = filled(tmp_path, 8, namespace_bytes=4 * CHUNK_BYTES)
    dry = run(capsys, "gc", "--config", str(path), "--dry-run", "--json")
    shared = next(r for r in dry if r["tier"] == "shared")  # type: ignore[union-attr]
    assert shared["deleted_chunks"] == 5  # down to 90% of 4 chunks
    assert len(list((tmp_path / "shared" / "chunks").rglob("*.kvc"))) == 8
    done = run(capsys, "gc", "--config", str(path), "--json")
    assert any("skipped" in r for r in done)  # type: ignore[union-attr]
    assert len(list((tmp_path / "shared" / "chunks").rglob("*.kvc"))) == 3
    assert list((tmp_path / "shared" / "notes" / "journal").iterdir()), "journaled"


def test_rm_deletes_a_namespace_and_refuses_a_running_servers_local_tier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = filled(tmp_path, 4)
    out = run(capsys, "rm", "--config", str(path), "--namespace", NS.hex()[:12],
              "--tier", "shared", "--json")
    assert out == [{"tier": "shared", "dry_run": False, "deleted_chunks": 4,
                    "deleted_bytes": 4 * CHUNK_BYTES}]
    assert not list((tmp_path / "shared" / "chunks").rglob("*.kvc"))
    with NodeServer(ServerConfig.from_yaml(path)):
        assert main(["rm", "--config", str(path), "--namespace", NS.hex(),
                     "--tier", "disk"]) == 2
        assert "its server is running" in capsys.readouterr().err
    assert len(list((tmp_path / "disk" / "chunks").rglob("*.kvc"))) == 4
    assert main(["rm", "--config", str(path), "--namespace", NS.hex(), "--tier", "nope"]) == 2


def test_rm_resolves_the_namespace_across_all_tiers_before_deleting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = filled(tmp_path, 4)  # NS on both tiers
    other = NS[:1] + bytes(31)  # shares NS's first hex digits
    data = yaml.safe_load(path.read_text())
    data["tiers"] = data["tiers"][1:]  # the shared tier only
    only_shared = tmp_path / "shared-only.yaml"
    only_shared.write_text(yaml.safe_dump(data))
    store = TieredStore(ServerConfig.from_yaml(only_shared), arena_name=arena_name())
    try:
        ks = keys(2, "other")
        slots = store.reserve(1, other, ks, payload_len=100, tokens=16)
        assert None not in slots and store.commit(ks) == 2
        settle(store)
    finally:
        store.close(drain_s=5)
    assert main(["rm", "--config", str(path), "--namespace", NS.hex()[:2]]) == 2
    assert "nothing was deleted" in capsys.readouterr().err
    assert len(list((tmp_path / "disk" / "chunks").rglob("*.kvc"))) == 4, "disk untouched"
    assert len(list((tmp_path / "shared" / "chunks").rglob("*.kvc"))) == 6


def test_rm_journals_its_deletes_in_notes_of_bounded_size(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = filled(tmp_path, 8)
    monkeypatch.setattr(admin, "JOURNAL_BATCH", 3)
    out = run(capsys, "rm", "--config", str(path), "--namespace", NS.hex(),
              "--tier", "shared", "--json")
    assert out[0]["deleted_chunks"] == 8
    tier = FsTier("shared", ServerConfig.from_yaml(path).tiers[1])
    notes = [journal.decode(tier.get_note(n) or b"") for n in tier.list_notes(journal.PREFIX)]
    deletes = [d.records for d in notes if d.records[0][0] == "-"]  # not the store's "+"
    assert sorted(map(len, deletes)) == [2, 3, 3], "8 records in notes of at most 3"
