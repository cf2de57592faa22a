"""The trust figures of ``kvtier bench micro`` and ``bench shared`` measure what they say."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench import auth, flood


def test_auth_read_reads_and_verifies_with_and_without_the_secret(tmp_path: Path) -> None:
    tier = auth.tier_from({"type": "fs", "options": {"path": str(tmp_path / "fs")}})
    try:
        rows, figures = auth.auth_read("fs", tier, 64 << 10, count=4, rounds=2)
    finally:
        tier.close()
    assert figures["fs_auth_read_ratio"] > 0 and len(rows) == 1
    assert not list((tmp_path / "fs" / "chunks").rglob("*.kvc")), "its chunks are removed"


def test_note_apply_lock_refuses_the_hostile_note_and_applies_the_full_one(
        tmp_path: Path) -> None:
    _rows, figures = auth.note_apply_lock(tmp_path)
    assert figures["note_20mb_lock_ms"] == 0.0, "a 20 MB note never reaches the lock"
    assert 0 < figures["note_full_lock_ms"] == figures["note_apply_lock_ms"]


def test_the_flood_case_floods_and_times_lookups_with_and_without(tmp_path: Path) -> None:
    rows, figures = flood.bench(tmp_path, repeats=1, phase_s=0.5)
    assert figures["flood_records_per_phase"][0] > 0, "the peer's notes were taken in"
    assert figures["quiet_lookup_p50_ms"] > 0 and figures["flood_lookup_max_ms"] > 0
    assert len(figures["flood_lookup_max_ms_each"]) == 1 and len(rows) == 6, "totals and a phase"
    assert 0 < figures["flood_journal_hold_cpu_max_ms_each"][0] < 1000
