"""``kvtier bench sweep --repeat K``: the order runs take, what ``sweep.json`` keeps, the cliff
on medians, resuming per repeat, and the figure's error bars.

The stacks here start nothing and each run's figures come from a table (the function that
runs one point is replaced), so these tests are about the sweep's bookkeeping, not about
serving: ``test_sweep.py`` runs the sweep end to end on real stub servers.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import stacks, sweep_figure
from kvtier.bench.provenance import provenance
from kvtier.bench.stacks import StackEnv, StackSpec, StartedConfig
from kvtier.bench.sweep import Sweep, schedule
from kvtier.cli import main

Key = tuple[str, int, int]  # (configuration, users, repeat)


class Fake:
    """Stacks that start nothing and runs whose throughput is ``figures[(name, users,
    repeat)]`` (1000 when absent), in the order they were asked for."""

    def __init__(self, figures: dict[Key, float] | None = None) -> None:
        self.figures = figures or {}
        self.calls: list[Key] = []
        self.starts: list[str] = []
        self.fail: set[Key] = set()
        self.interrupt: Key | None = None

    def start(self, name: str) -> Any:
        def start(env: StackEnv) -> StartedConfig:
            self.starts.append(name)
            return StartedConfig("http://127.0.0.1:9", [])
        return start

    def run_point(self, name: str, _stack: StartedConfig, _history: int, users: int,
                  repeat: int) -> dict[str, Any]:
        key = (name, users, repeat)
        if key == self.interrupt:
            raise KeyboardInterrupt
        self.calls.append(key)
        tput = self.figures.get(key, 1000.0)
        if key in self.fail:
            return {"throughput_tok_s": None, "p99_ttft_s": None, "hit_ratio": None,
                    "requests": users, "errors": users, "error": "every request failed: http"}
        return {"throughput_tok_s": tput, "p99_ttft_s": 1000.0 / tput, "hit_ratio": 0.9,
                "output_tok_s": tput / 10, "requests_per_s": 1.0, "p50_ttft_s": 0.1,
                "p99_itl_s": 0.01, "requests": users, "errors": 0, "error": None,
                "result": f"points/{name}-h32-u{users}-r{repeat}.json"}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    fake = Fake()
    for name in ("device", "arena+disk", "fake-a", "fake-b", "fake-c", "f+roundrobin",
                 "f+cache"):
        monkeypatch.setitem(stacks.STACKS, name, StackSpec(name, f"fake {name}",
                                                           fake.start(name)))
    monkeypatch.setattr("kvtier.bench.sweep.warm_up", lambda _stack, _model: None)
    monkeypatch.setattr(Sweep, "run_point", fake.run_point)
    return fake


def sweep(tmp_path: Path, *extra: str) -> int:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return main(["bench", "sweep", "--model", str(model), "--out", str(tmp_path / "out"),
                 "--history", "32", "--device-blocks", "160", *extra])


def load(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "out" / "sweep.json").read_text()))


def test_each_repeat_is_a_pass_over_every_configuration_starting_further_down(
        tmp_path: Path, fake: Fake) -> None:
    assert sweep(tmp_path, "--configs", "fake-a,fake-b,fake-c", "--users", "1,2",
                 "--repeat", "3") == 0
    assert fake.starts == ["fake-a", "fake-b", "fake-c", "fake-b", "fake-c", "fake-a",
                           "fake-c", "fake-a", "fake-b"]
    # on each stack its points in order of users; one stack per configuration and repeat
    assert fake.calls[:6] == [("fake-a", 1, 1), ("fake-a", 2, 1), ("fake-b", 1, 1),
                              ("fake-b", 2, 1), ("fake-c", 1, 1), ("fake-c", 2, 1)]
    assert [r for _, _, r in fake.calls] == [1] * 6 + [2] * 6 + [3] * 6


def test_the_schedule_spreads_each_configuration_over_the_positions() -> None:
    assert schedule(["a", "b"], 1) == [(1, "a"), (1, "b")]
    assert schedule(["a", "b"], 2) == [(1, "a"), (1, "b"), (2, "b"), (2, "a")]
    order = schedule(list("abcdef"), 3)
    assert [n for r, n in order if r == 2] == list("cdefab")
    assert [n for r, n in order if r == 3] == list("efabcd")
    assert len(order) == 18 and {n for _, n in order} == set("abcdef")


def test_the_json_keeps_every_run_and_each_points_median_and_range(tmp_path: Path,
                                                                    fake: Fake) -> None:
    fake.figures = {("fake-a", 2, 1): 900.0, ("fake-a", 2, 2): 1300.0,
                    ("fake-a", 2, 3): 1000.0}
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2", "--repeat", "3",
                 "--user-order", "shuffled") == 0
    doc = load(tmp_path)
    assert doc["version"] == 2
    (point,) = doc["configs"]["fake-a"]["points"]
    assert [r["throughput_tok_s"] for r in point["runs"]] == [900.0, 1300.0, 1000.0]
    assert [r["repeat"] for r in point["runs"]] == [1, 2, 3]
    assert point["throughput_tok_s"] == 1000.0  # the median, not the mean (1066.7)
    assert point["min"]["throughput_tok_s"] == 900.0
    assert point["max"]["throughput_tok_s"] == 1300.0
    assert point["p99_ttft_s"] == 1.0 and point["max"]["p99_ttft_s"] == pytest.approx(1 / 0.9)
    assert point["requests"] == 6 and point["runs_ok"] == 3 and point["failed_runs"] == 0
    # each run names the invocation that made it: its command, command line and commit
    (inv,) = doc["invocations"]
    assert {r["invocation"] for r in point["runs"]} == {0}
    assert "--repeat 3" in inv["command"] and inv["command"] == doc["command"]
    assert "--user-order shuffled" in inv["command"], "the command says what was run"
    assert isinstance(inv["argv"], list) and inv["kvtier_version"]
    assert inv["commit"] == provenance()["commit"]


def test_a_failed_run_is_kept_and_left_out_of_the_median(tmp_path: Path, fake: Fake) -> None:
    fake.figures = {("fake-a", 2, 1): 500.0, ("fake-a", 2, 3): 700.0}
    fake.fail = {("fake-a", 2, 2)}
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2", "--repeat", "3") == 0
    (point,) = load(tmp_path)["configs"]["fake-a"]["points"]
    assert point["runs_ok"] == 2 and point["failed_runs"] == 1 and point["error"] is None
    assert point["throughput_tok_s"] == 600.0 and point["errors"] == 2
    assert point["runs"][1]["error"] == "every request failed: http"
    assert "2 +1 failed" in sweep_figure.table_text(load(tmp_path)["configs"])


def test_resuming_runs_only_the_missing_runs_of_each_repeat(tmp_path: Path, fake: Fake) -> None:
    fake.interrupt = ("fake-b", 2, 2)  # repeat 2 runs b, then a: stopped half way through b
    # stopped (Ctrl-C): exit status 130, and what finished is kept
    assert sweep(tmp_path, "--configs", "fake-a,fake-b", "--users", "1,2", "--repeat", "2") \
        == 130
    fake.interrupt, fake.calls, fake.starts = None, [], []
    assert sweep(tmp_path, "--configs", "fake-a,fake-b", "--users", "1,2", "--repeat", "2") == 0
    assert fake.calls == [("fake-b", 2, 2), ("fake-a", 1, 2), ("fake-a", 2, 2)]
    assert fake.starts == ["fake-b", "fake-a"]
    # a larger --repeat adds repeats; the same one again runs nothing
    fake.calls, fake.starts = [], []
    assert sweep(tmp_path, "--configs", "fake-a,fake-b", "--users", "1,2", "--repeat", "3") == 0
    assert sorted(fake.calls) == [("fake-a", 1, 3), ("fake-a", 2, 3), ("fake-b", 1, 3),
                                  ("fake-b", 2, 3)]
    fake.calls = []
    assert sweep(tmp_path, "--configs", "fake-a,fake-b", "--users", "1,2", "--repeat", "3") == 0
    assert fake.calls == []
    doc = load(tmp_path)
    for cfg in doc["configs"].values():
        for point in cfg["points"]:
            assert [r["repeat"] for r in point["runs"]] == [1, 2, 3]
    assert len(doc["invocations"]) == 4
    assert [r["invocation"] for r in doc["configs"]["fake-a"]["points"][0]["runs"]] == [0, 1, 2]


def test_retry_failed_reruns_only_the_failed_run(tmp_path: Path, fake: Fake) -> None:
    fake.fail = {("fake-a", 2, 2)}
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "1,2", "--repeat", "2") == 0
    fake.fail, fake.calls = set(), []
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "1,2", "--repeat", "2") == 0
    assert fake.calls == []  # a failure is a result too
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "1,2", "--repeat", "2",
                 "--retry-failed") == 0
    assert fake.calls == [("fake-a", 2, 2)]
    point = load(tmp_path)["configs"]["fake-a"]["points"][1]
    assert point["runs_ok"] == 2 and point["failed_runs"] == 0


def test_a_configuration_that_cannot_start_is_tried_once_per_sweep(
        tmp_path: Path, fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(env: StackEnv) -> StartedConfig:
        fake.starts.append("broken")
        raise stacks.StackError("broken exited with status 3")

    monkeypatch.setitem(stacks.STACKS, "broken", StackSpec("broken", "x", broken))
    assert sweep(tmp_path, "--configs", "broken,fake-a", "--users", "1", "--repeat", "3") == 0
    assert fake.starts.count("broken") == 1 and fake.starts.count("fake-a") == 3
    (point,) = load(tmp_path)["configs"]["broken"]["points"]
    assert point["failed_runs"] == 3 and "status 3" in point["error"]


def test_the_cliff_reads_the_medians(tmp_path: Path, fake: Fake) -> None:
    # repeat 1 alone: arena+disk dips under 80% at 8 users (790) and the ratio would be
    # 4 / 8; the medians say it holds (850 of 1000) and device falls to 450
    runs = {("device", 2): (1000, 1000, 1000), ("device", 4): (900, 1000, 1100),
            ("device", 8): (400, 450, 700), ("arena+disk", 2): (1000, 1000, 1000),
            ("arena+disk", 4): (1000, 1000, 1000), ("arena+disk", 8): (790, 850, 900)}
    fake.figures = {(n, u, r + 1): float(v[r]) for (n, u), v in runs.items() for r in range(3)}
    assert sweep(tmp_path, "--configs", "device,arena+disk", "--users", "2,4,8",
                 "--repeat", "3") == 0
    (c,) = load(tmp_path)["cliff"]
    assert c["device_half_users"] == 8 and c["tiered_80_users"] == 8
    assert c["cliff_ratio"] == 1.0 and c["cliff_ratio_is_lower_bound"]
    first = {name: {"points": [dict(p, throughput_tok_s=p["runs"][0]["throughput_tok_s"])
                               for p in cfg["points"]]}
             for name, cfg in load(tmp_path)["configs"].items()}
    assert sweep_figure.cliff(first, 32)["cliff_ratio"] == 0.5  # what one run would say


def test_the_figure_draws_medians_with_min_max_error_bars(tmp_path: Path, fake: Fake) -> None:
    fake.figures = {("fake-a", 2, 1): 900.0, ("fake-a", 2, 2): 1300.0,
                    ("fake-a", 4, 1): 2000.0, ("fake-a", 4, 2): 1600.0}
    assert sweep(tmp_path, "--configs", "fake-a,fake-b", "--users", "2,4", "--repeat", "3") == 0
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000
    fig = sweep_figure.figure(load(tmp_path))
    try:
        bars = fig.axes[0].containers[0]  # fake-a's throughput
        xs, ys = bars.lines[0].get_data()
        assert list(xs) == [2, 4] and list(ys) == [1000.0, 1600.0]
        (segments,) = [c.get_segments() for c in bars.lines[2]]
        assert [[tuple(v) for v in s] for s in segments] == [[(2, 900.0), (2, 1300.0)],
                                                            [(4, 1000.0), (4, 2000.0)]]
        assert "median of 3 runs" in fig._suptitle.get_text()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_single_run_sweep_draws_no_error_bars(tmp_path: Path, fake: Fake) -> None:
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2,4") == 0
    fig = sweep_figure.figure(load(tmp_path))
    try:
        assert not fig.axes[0].containers[0].has_yerr
        assert "median" not in fig._suptitle.get_text()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_version_1_sweep_resumes_as_repeat_1(tmp_path: Path, fake: Fake) -> None:
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2") == 0
    doc = load(tmp_path)
    (point,) = doc["configs"]["fake-a"]["points"]
    (run,) = point["runs"]
    v1 = {k: v for k, v in run.items() if k not in ("repeat", "invocation")}
    doc["configs"]["fake-a"]["points"] = [{"users": 2, "history_tokens": 32, **v1}]
    doc["version"] = 1
    (tmp_path / "out" / "sweep.json").write_text(json.dumps(doc))
    fake.calls = []
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2", "--repeat", "2") == 0
    assert fake.calls == [("fake-a", 2, 2)]
    (point,) = load(tmp_path)["configs"]["fake-a"]["points"]
    assert [r["repeat"] for r in point["runs"]] == [1, 2]
    assert point["runs"][0]["result"] == run["result"] and point["runs"][0]["invocation"] is None


def test_users_up_to_64_and_beyond_are_swept(tmp_path: Path, fake: Fake) -> None:
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2,64,128") == 0
    assert [u for _, u, _ in fake.calls] == [2, 64, 128]


def test_a_repeat_below_one_is_refused(tmp_path: Path, fake: Fake,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2", "--repeat", "0") == 2
    assert "--repeat: expected at least 1" in capsys.readouterr().err
    assert fake.calls == []


def test_provenance_names_the_commit_of_a_checkout_else_the_version(tmp_path: Path) -> None:
    here = provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=20, cwd=Path(__file__).parent)
    if head.returncode == 0:
        assert here["commit"] == head.stdout.strip() and isinstance(here["dirty"], bool)
    elsewhere = provenance(tmp_path)
    assert elsewhere["commit"] is None and elsewhere["dirty"] is None
    assert elsewhere["kvtier_version"] == here["kvtier_version"]
    installed = tmp_path / "lib" / "site-packages" / "kvtier"
    installed.mkdir(parents=True)
    assert provenance(installed)["commit"] is None


def test_each_front_is_compared_with_its_setups_round_robin_repeat_by_repeat(
        tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    fake.figures = {("f+cache", 2, 1): 1200.0, ("f+cache", 2, 2): 1100.0,
                    ("f+cache", 2, 3): 1300.0, ("fake-a", 2, 2): 500.0}
    assert sweep(tmp_path, "--configs", "f+roundrobin,f+cache,fake-a", "--users", "2",
                 "--repeat", "3", "--compare", "fake-a:f+roundrobin") == 0
    cache, other = load(tmp_path)["comparisons"]
    assert (cache["candidate"], cache["baseline"]) == ("f+cache", "f+roundrobin")
    assert cache["throughput_tok_s"]["ratios"] == pytest.approx([1.2, 1.1, 1.3])
    assert cache["throughput_tok_s"]["verdict"] == cache["p99_ttft_s"]["verdict"] == "better"
    assert other["candidate"] == "fake-a"
    assert other["throughput_tok_s"]["ratios"] == pytest.approx([1.0, 0.5, 1.0])
    assert other["throughput_tok_s"]["verdict"] == "within noise"
    out = capsys.readouterr().out
    assert "f+cache / f+roundrobin" in out and "1.20x (1.20, 1.10, 1.30)" in out


def test_a_compare_naming_a_configuration_the_sweep_lacks_is_refused_before_running(
        tmp_path: Path, fake: Fake, capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep(tmp_path, "--configs", "fake-a", "--users", "2",
                 "--compare", "fake-a:f+roundrobin") == 2
    assert "'f+roundrobin' is neither in --configs" in capsys.readouterr().err
    assert fake.calls == [], "nothing ran"
    assert sweep(tmp_path, "--configs", "fake-a", "--compare", "fake-a") == 2
    assert "CANDIDATE:BASELINE" in capsys.readouterr().err
