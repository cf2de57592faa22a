"""``kvtier bench sweep``: the cliff by hand, and the framework end to end on stub stacks.

The stub configurations start ``tests/bench/stub_server.py`` as real processes (real HTTP,
started, waited for and stopped like any stack); no vLLM. A configuration whose process dies
at once records its failure on every point.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import stacks
from kvtier.bench.stacks import (
    STACKS,
    ProcSpec,
    StackEnv,
    StartedConfig,
    engine,
    free_port,
    launch,
    register_stack,
)
from kvtier.bench.sweep_figure import Held, cliff, falls_to_half, still_holds, summary_line
from kvtier.cli import main

pytest.importorskip("httpx")
STUB = str(Path(__file__).with_name("stub_server.py"))
STARTED: list[str] = []


def _start_stub(env: StackEnv) -> StartedConfig:
    STARTED.append(env.workdir.parent.name)
    port = free_port()
    return launch(env, [engine("stub", [sys.executable, STUB, "--port", str(port)], port)],
                  port)


def _start_broken(env: StackEnv) -> StartedConfig:
    STARTED.append("broken")
    port = free_port()
    spec = ProcSpec("broken", [sys.executable, "-c", "print('no engine here'); raise "
                               "SystemExit(3)"], stacks.http_ready(f"http://127.0.0.1:{port}"))
    return launch(env, [spec], port)


for _name, _start in (("stub-a", _start_stub), ("stub-b", _start_stub),
                      ("broken", _start_broken)):
    if _name not in STACKS:
        register_stack(_name, f"test stack {_name}", _start)


def pts(*pairs: tuple[int, float]) -> list[dict[str, Any]]:
    return [{"users": u, "history_tokens": 100, "throughput_tok_s": t} for u, t in pairs]


def test_device_falls_to_half_after_its_peak() -> None:
    # peak 1000 at 4 users; 600 at 8 is above half; 500 at 16 is half
    assert falls_to_half(pts((2, 800), (4, 1000), (8, 600), (16, 500), (32, 100))) == 16
    assert falls_to_half(pts((2, 400), (4, 1000), (8, 900))) is None  # 400 before the peak


def test_tiered_holds_80_percent_of_its_peak() -> None:
    assert still_holds(pts((2, 900), (4, 1000), (8, 950), (16, 810), (32, 790))) == \
        Held(16, lower_bound=False)


def test_a_dip_under_80_percent_ends_the_hold_whatever_comes_after() -> None:
    # 100 -> 50 -> 85: it held up to 2 users, not 4
    assert still_holds(pts((2, 100), (4, 50), (8, 85))) == Held(2, lower_bound=False)
    assert still_holds(pts((1, 60), (2, 100), (4, 79), (8, 95))) == Held(2, lower_bound=False)


def test_a_hold_the_range_never_ended_is_a_lower_bound() -> None:
    assert still_holds(pts((2, 900), (4, 1000), (8, 950), (16, 810))) == \
        Held(16, lower_bound=True)
    assert still_holds(pts((2, 500), (4, 1000))) == Held(4, lower_bound=True)
    # points before the peak do not end it: only what comes after the peak
    assert still_holds(pts((2, 100), (4, 1000), (8, 900))) == Held(8, lower_bound=True)
    assert still_holds([]) is None


def test_device_half_is_the_first_point_after_the_peak_at_or_below_half() -> None:
    assert falls_to_half(pts((2, 1000), (4, 500), (8, 900), (16, 100))) == 4
    assert falls_to_half(pts((2, 1000), (4, 501))) is None
    assert falls_to_half([]) is None


def test_cliff_ratio() -> None:
    configs = {"device": {"points": pts((2, 1000), (4, 800), (8, 450), (16, 200))},
               "arena+disk": {"points": pts((2, 1000), (4, 1100), (8, 1050), (16, 900),
                                            (32, 700))}}
    c = cliff(configs, 100)
    assert c["device_half_users"] == 8 and c["tiered_80_users"] == 16
    assert c["cliff_ratio"] == 2.0
    assert not c["tiered_80_users_is_lower_bound"] and not c["cliff_ratio_is_lower_bound"]
    assert summary_line(c).startswith("cliff_ratio: 2 (") and "≥" not in summary_line(c)
    configs["device"]["points"] = pts((2, 1000), (4, 900))
    assert cliff(configs, 100)["cliff_ratio"] is None  # never fell to half: undefined


def test_a_cliff_ratio_whose_hold_was_not_reached_says_at_least() -> None:
    configs = {"device": {"points": pts((2, 1000), (4, 800), (8, 450), (16, 200))},
               "arena+disk": {"points": pts((2, 1000), (4, 1100), (8, 1050), (16, 900))}}
    c = cliff(configs, 100)
    assert c["tiered_80_users"] == 16 and c["tiered_80_users_is_lower_bound"]
    assert c["cliff_ratio"] == 2.0 and c["cliff_ratio_is_lower_bound"]
    line = summary_line(c)
    assert line.startswith("cliff_ratio: ≥2 (") and "up to ≥16" in line, line


def sweep(tmp_path: Path, *extra: str) -> int:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return main(["bench", "sweep", "--model", str(model), "--out", str(tmp_path / "out"),
                 "--num-rounds", "2", "--shared-system-prompt", "16", "--question-len", "8",
                 "--answer-len", "3", "--history", "32", "--ready-timeout", "60", *extra])


def test_sweep_runs_each_point_once_and_resumes(tmp_path: Path) -> None:
    STARTED.clear()
    assert sweep(tmp_path, "--configs", "stub-a,stub-b", "--users", "1,2") == 0
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert STARTED == ["stub-a", "stub-b"]  # one stack per configuration, one at a time
    for name in ("stub-a", "stub-b"):
        points = doc["configs"][name]["points"]
        assert [p["users"] for p in points] == [1, 2]
        for p in points:
            assert p["error"] is None and p["throughput_tok_s"] > 0 and p["p99_ttft_s"] > 0
            assert 0 < p["hit_ratio"] < 1 and p["requests"] == 2 * p["users"]
            (run,) = p["runs"]  # one repeat: the point's medians are its one run's figures
            assert run["repeat"] == 1 and run["throughput_tok_s"] == p["throughput_tok_s"]
            assert p["min"]["throughput_tok_s"] == p["max"]["throughput_tok_s"] == \
                p["throughput_tok_s"]
            assert (tmp_path / "out" / run["result"]).exists()
    assert doc["cliff_ratio"] is None and doc["command"].startswith("kvtier bench sweep ")
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000
    # a rerun starts nothing; a wider one runs only the new point
    STARTED.clear()
    assert sweep(tmp_path, "--configs", "stub-a,stub-b", "--users", "1,2") == 0
    assert STARTED == []
    assert sweep(tmp_path, "--configs", "stub-a", "--users", "1,2,3") == 0
    assert STARTED == ["stub-a"]
    doc2 = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [p["users"] for p in doc2["configs"]["stub-a"]["points"]] == [1, 2, 3]
    assert doc2["configs"]["stub-a"]["points"][:2] == doc["configs"]["stub-a"]["points"]


def test_other_settings_are_refused_unless_fresh(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep(tmp_path, "--configs", "stub-a", "--users", "1") == 0
    assert sweep(tmp_path, "--configs", "stub-a", "--users", "1", "--answer-len", "4") == 2
    assert "other settings (workload)" in capsys.readouterr().err
    assert sweep(tmp_path, "--configs", "stub-a", "--users", "1", "--answer-len", "4",
                 "--fresh") == 0


def test_a_configuration_that_fails_records_its_failure(tmp_path: Path) -> None:
    STARTED.clear()
    assert sweep(tmp_path, "--configs", "broken,stub-a", "--users", "1,2") == 0
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    broken = doc["configs"]["broken"]
    assert "exited with status 3" in broken["failure"] and "no engine here" in broken["failure"]
    assert [p["error"] is not None for p in broken["points"]] == [True, True]
    assert STARTED == ["broken", "stub-a"]  # tried once, not once per point
    assert all(p["error"] is None for p in doc["configs"]["stub-a"]["points"])
    STARTED.clear()
    assert sweep(tmp_path, "--configs", "broken,stub-a", "--users", "1,2") == 0
    assert STARTED == []  # a failure is a result too
    assert sweep(tmp_path, "--configs", "broken,stub-a", "--users", "1,2",
                 "--retry-failed") == 0
    assert STARTED == ["broken"]


def test_unknown_configuration_lists_the_known_ones(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep(tmp_path, "--configs", "device,nope") == 2
    err = capsys.readouterr().err
    assert "unknown configuration 'nope'" in err and "arena+disk" in err and "lmcache" in err


def test_stopping_a_stack_ends_its_processes(tmp_path: Path) -> None:
    env = StackEnv(model="m", served_name="m", engine_args=(), workdir=tmp_path / "w")
    stack = _start_stub(env)
    assert stack.alive()
    pid = stack.procs[0].popen.pid
    stack.stop()
    assert not stack.alive() and stack.procs[0].popen.returncode is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_a_device_cache_smaller_than_one_sequence_is_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    assert sweep(tmp_path, "--configs", "stub-a", "--device-blocks", "1",
                 "--max-model-len", "8192") == 2
    assert "vLLM refuses to start" in capsys.readouterr().err


def test_a_stack_that_dies_reports_its_root_cause(tmp_path: Path) -> None:
    env = StackEnv(model="m", served_name="m", engine_args=(), workdir=tmp_path / "w")
    script = ("import sys; print('WARNING ulimit noise'); "
              "print('ValueError: Available memory is too low'); "
              "print('Traceback ...'); print('RuntimeError: Engine core failed'); sys.exit(1)")
    port = free_port()
    spec = ProcSpec("engine", [sys.executable, "-c", script],
                    stacks.http_ready(f"http://127.0.0.1:{port}"))
    with pytest.raises(stacks.StackError) as info:
        launch(env, [spec], port)
    first_line = str(info.value).splitlines()[0]
    assert first_line == ("engine exited with status 1 before it was ready: "
                          "ValueError: Available memory is too low")
