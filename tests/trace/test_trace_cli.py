"""``kvtier trace analyze | simulate | generate`` end to end, through register()."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trace_helpers import run_trace, write_lines, write_trace_a

from kvtier.errors import ConfigError
from kvtier.trace.cli import main
from kvtier.trace.formats import TraceFormatError


def read_json(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_simulate_json_has_the_required_names(tmp_path: Path) -> None:
    """Trace A, LRU host of 3 chunks (1536 tokens): 4 hits of 12 blocks (hand-worked in
    test_trace_simulate); token ratio the same (all blocks full). The 12 - 4 = 8 missed
    blocks are written to host: at 2 B/token, 8 * 1024 B = 8192 bytes."""
    out = tmp_path / "sim.json"
    rc = run_trace("simulate", str(write_trace_a(tmp_path / "a.jsonl")), "--tier", "host=1536tok",
                   "--bytes-per-token", "2", "--json", str(out))
    assert rc == 0
    doc = read_json(out)
    assert doc["block_hit_ratio"] == pytest.approx(1 / 3)
    assert doc["token_hit_ratio"] == pytest.approx(1 / 3)
    host = doc["tiers"]["host"]
    assert (host["hits"], host["capacity_chunks"], host["bytes_written"]) == (4, 3, 8192)
    assert doc["recomputed_tokens"] == 8 * 512


def test_simulate_two_tiers_with_per_tier_options(tmp_path: Path) -> None:
    """The write-back scenario of test_trace_simulate: host 1 chunk, disk write-back, inf:
    [1] [2] [2] [1] [2] -> only r5 hits, on disk (its slot's victim is on disk already):
    1 of 5 blocks."""
    lines = [f'{{"timestamp": {i}, "input_length": 512, "output_length": 1, "hash_ids": [{b}]}}'
             for i, b in enumerate((1, 2, 2, 1, 2))]
    out = tmp_path / "sim.json"
    rc = run_trace("simulate", str(write_lines(tmp_path / "t.jsonl", lines)),
                   "--tier", "host=512tok", "--tier", "disk=inf:write=back:eviction=arc",
                   "--json", str(out))
    assert rc == 0
    doc = read_json(out)
    assert doc["block_hit_ratio"] == pytest.approx(1 / 5)
    assert doc["tiers"]["disk"]["write"] == "back"
    assert doc["tiers"]["disk"]["eviction"] == "arc"
    assert (doc["tiers"]["host"]["hits"], doc["tiers"]["disk"]["hits"]) == (0, 1)


def test_simulate_host_free_target(tmp_path: Path) -> None:
    """test_free_target_writes_back_ahead through the command line: host 2 chunks with
    free_target=0.5 over a write-back disk, [1] [2] [3] [1] [3] -> 2 disk hits of 5."""
    lines = [f'{{"timestamp": {i}, "input_length": 512, "output_length": 1, "hash_ids": [{b}]}}'
             for i, b in enumerate((1, 2, 3, 1, 3))]
    out = tmp_path / "sim.json"
    rc = run_trace("simulate", str(write_lines(tmp_path / "t.jsonl", lines)),
                   "--tier", "host=1024tok:free_target=0.5", "--tier", "disk=inf:write=back",
                   "--json", str(out))
    assert rc == 0
    assert read_json(out)["tiers"]["disk"]["hits"] == 2


def test_analyze_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Trace A: infinite-cache hit ratio 6/12, never reused 3 of 6 blocks."""
    out = tmp_path / "an.json"
    png = tmp_path / "an.png"
    rc = run_trace("analyze", str(write_trace_a(tmp_path / "a.jsonl")), "--json", str(out),
                   "--plot", str(png), "--bytes-per-token", "2")
    assert rc == 0
    doc = read_json(out)
    assert doc["block_hit_ratio"] == pytest.approx(0.5)
    assert doc["analysis"]["reuse"]["never_reused_share"] == pytest.approx(0.5)
    assert png.stat().st_size > 10_000
    assert "infinite-cache prefix hit ratio  50.0% of blocks" in capsys.readouterr().out


def test_sweep_json_and_plot(tmp_path: Path) -> None:
    """Sweep host 1, 2, 3 chunks and inf over LRU on trace A: 2/12 at 1 chunk, 4/12 at 2 and
    at 3 (test_trace_simulate), 6/12 unbounded; Belady 5/12 at 2 and 6/12 at 3 (hand-worked
    in test_trace_belady).
    LRU at 1 chunk: each request reserves the only slot for its first recomputed block and
    the rest is refused, so host holds 1, 2, 1, 2 after r1..r4: r2 and r4 hit 1 -> 2/12.
    Belady at 1 chunk keeps block 1 (next use soonest) and bypasses the rest: r2, r3, r4
    each hit 1 -> 3/12.
    Target 90% of 0.5 = 0.45, i.e. all 6 hits: LRU only unbounded, Belady at 3 chunks."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = run_trace("simulate", str(write_trace_a(tmp_path / "a.jsonl")),
                   "--eviction", "lru", "--sweep", "512tok,1024tok,1536tok,inf",
                   "--json", str(out), "--plot", str(png))
    assert rc == 0
    got = {(p["policy"], p["host_chunks"]): round(p["block_hit_ratio"] * 12)
           for p in read_json(out)["sweep"]}
    assert got == {("lru", 1): 2, ("lru", 2): 4, ("lru", 3): 4, ("lru", None): 6,
                   ("belady", 1): 3, ("belady", 2): 5, ("belady", 3): 6, ("belady", None): 6}
    targets = read_json(out)["recommendation"]
    assert targets["smallest_host_chunks"] == {"lru": None, "belady": 3}
    assert targets["reached"] == {"lru": True, "belady": True}
    assert png.stat().st_size > 10_000


def test_generate_writes_mooncake(tmp_path: Path) -> None:
    out = tmp_path / "g.jsonl"
    assert run_trace("generate", "-o", str(out), "--sessions", "5", "--seed", "1") == 0
    first = json.loads(out.read_text().splitlines()[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}


def test_bad_line_is_an_error_and_skip_bad_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "t.jsonl", [
        '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}', "{oops"])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2"):
        run_trace("analyze", str(path))
    assert run_trace("analyze", str(path), "--skip-bad") == 0
    assert "skipped 1 malformed lines (first: " in capsys.readouterr().err
    assert main(["analyze", str(path)]) == 2
    assert "t.jsonl:2: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tier", "disk=1Mtok"], "first --tier must be the host"),
        (["--tier", "host=64GiB"], "--bytes-per-token or --model"),
        (["--tier", "host=1Mtok", "--tier", "disk=2Mtok:colour=red"], "bad option 'colour=red'"),
        (["--tier", "host=1Mtok:free_target=1.5"], "free_target must be a number in"),
        (["--tier", "host=1Mtok", "--tier", "disk=2Mtok:free_target=0.1"], "host tier only"),
        (["--tier", "host=1Mtok", "--admission", "after_lunch=2"], "unknown admission rule"),
        (["--tier", "host=1Mtok", "--eviction", "fifo"], "unknown eviction policy 'fifo'"),
        (["--tier", "host=1Mtok", "--eviction", "lru,arc"], "one policy unless --sweep"),
    ],
)
def test_bad_simulate_options(tmp_path: Path, args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_trace("simulate", str(write_trace_a(tmp_path / "a.jsonl")), *args)
