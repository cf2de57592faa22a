"""A sweep killed with SIGKILL resumes: every finished run is kept as it was (its files
untouched), the rest run, and the result has the structure of a sweep never interrupted.

Real processes: the sweep runs in its own process (tests/bench/sweep_driver.py) over stub
stacks that are real HTTP servers; the test kills it as a machine's owner or the kernel would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("httpx")
DRIVER = str(Path(__file__).with_name("sweep_driver.py"))
ROOT = Path(__file__).resolve().parents[2]
USERS = (1, 2, 3)
REPEATS = 3
RUNS = len(USERS) * REPEATS * 2  # two configurations


def argv(tmp_path: Path, out: str, *extra: str) -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return [sys.executable, DRIVER, "--model", str(model), "--out", str(tmp_path / out),
            "--configs", "stub-a,stub-b", "--users", ",".join(map(str, USERS)),
            "--repeat", str(REPEATS), "--num-rounds", "2", "--shared-system-prompt", "16",
            "--question-len", "8", "--answer-len", "3", "--history", "32",
            "--ready-timeout", "60", *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "MPLBACKEND": "Agg"}


def finish(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)


def files(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every run's record and the result file it names: bytes and modification time. (A
    result written just before the kill, its record not yet, is not a finished run.)"""
    import json

    records = sorted((out / "runs").glob("stub-*.json"))
    paths = records + [out / json.loads(p.read_text())["run"]["result"] for p in records]
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def shape(doc: dict[str, Any]) -> dict[str, Any]:
    """What an interrupted and an uninterrupted sweep must share: the keys, the points, and
    per point the repeats that ran, with no failure."""
    return {"keys": sorted(doc), "configs": {
        name: [(p["users"], p["history_tokens"], sorted(r["repeat"] for r in p["runs"]),
                p["error"], p["runs_ok"], sorted(p)) for p in cfg["points"]]
        for name, cfg in sorted(doc["configs"].items())}}


def kill_after(cmd: list[str], out: Path, runs: int) -> None:
    """Start the sweep, SIGKILL it once ``runs`` runs are recorded, and wait until its stub
    servers are gone too (they die with their parent: PR_SET_PDEATHSIG)."""
    import psutil

    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(list((out / "runs").glob("*.json"))) < runs:
            assert proc.poll() is None, f"the sweep ended before {runs} runs: {proc.returncode}"
            assert time.monotonic() < deadline, "the sweep made no progress"
            time.sleep(0.02)
        children = psutil.Process(proc.pid).children(recursive=True)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:  # not expected; never leave a server behind
        child.kill()
    assert alive == [], "a stack outlived the killed sweep"


def test_a_killed_sweep_resumes_keeping_every_finished_run(tmp_path: Path) -> None:
    import json

    whole = finish(argv(tmp_path, "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = json.loads((tmp_path / "whole" / "sweep.json").read_text())

    out = tmp_path / "killed"
    kill_after(argv(tmp_path, "killed"), out, runs=4)
    kept = files(out)
    done = len([k for k in kept if k.startswith("runs/")])
    assert 4 <= done < RUNS
    (out / "bogus").mkdir()
    (out / "bogus" / "x.json").write_text("{not json")
    (out / "runs" / "bogus.json").symlink_to(out / "bogus" / "x.json")  # skipped, not fatal

    resumed = finish(argv(tmp_path, "killed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {out}: {done} of {RUNS} runs done and kept" in resumed.stderr
    assert "skipping" in resumed.stderr and "bogus.json" in resumed.stderr
    assert (out / "bogus" / "x.json").read_text() == "{not json"
    after = files(out)
    assert {k: after[k] for k in kept} == kept, "a finished run's files were rewritten"
    assert len([k for k in after if k.startswith("runs/")]) == RUNS
    assert len([k for k in after if k.startswith("points/")]) == RUNS
    doc = json.loads((out / "sweep.json").read_text())
    assert shape(doc) == shape(reference)
    assert doc["cliff_ratio"] is None and reference["cliff_ratio"] is None  # no device/tiers

    # every run says which process made it; the kept ones were not made by the rerun
    first, last = doc["invocations"][0], doc["invocations"][-1]
    assert len(doc["invocations"]) == 2 and first["started"] <= last["started"]
    for key in ("command", "commit", "machine", "argv", "started"):
        assert key in first and key in last
    assert first["machine"]["cpus"] == os.cpu_count()
    runs = [r for cfg in doc["configs"].values() for p in cfg["points"] for r in p["runs"]]
    assert sorted(r["invocation"] for r in runs) == [0] * done + [1] * (RUNS - done)

    # the repeats interleave: every run of repeat 1 ended before any of repeat 2 began
    whole_runs = [r for cfg in reference["configs"].values() for p in cfg["points"]
                  for r in p["runs"]]
    for r in range(1, REPEATS):
        assert max(x["finished"] for x in whole_runs if x["repeat"] == r) <= \
            min(x["finished"] for x in whole_runs if x["repeat"] == r + 1)


def test_kept_runs_rebuild_the_summary_and_refuse_other_settings(tmp_path: Path) -> None:
    import json

    out = tmp_path / "killed"
    kill_after(argv(tmp_path, "killed"), out, runs=2)
    (out / "sweep.json").unlink(missing_ok=True)  # only the run records are left
    kept = files(out)
    done = len([k for k in kept if k.startswith("runs/")])

    other = finish(argv(tmp_path, "killed", "--answer-len", "4"))
    assert other.returncode == 2
    assert "was made with other settings" in other.stderr and "--fresh" in other.stderr
    assert files(out) == kept, "a refused sweep changed nothing"

    again = finish(argv(tmp_path, "killed", "--users", "1", "--repeat", "1"))
    assert again.returncode == 0, again.stderr[-3000:]
    doc = json.loads((out / "sweep.json").read_text())
    recovered = sum(len(p["runs"]) for c in doc["configs"].values() for p in c["points"])
    assert recovered >= done  # every kept run is back in the summary, whatever --users says
    assert {k: v for k, v in files(out).items() if k in kept} == kept
