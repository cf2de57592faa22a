"""``kvtier bench agents``: the agent workload's script, its retention field on and off, the
driver against a real HTTP endpoint (the stub server) and the figures of runs and repeats."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
from stub_server import StubState, stub_server

from kvtier.bench import agents_report as report
from kvtier.bench.agents import _summarize, engine_args, measure, modes, register
from kvtier.bench.agents_workload import AgentsConfig, GapShape, RetentionPlan, build
from kvtier.bench.tokens import counter_for
from kvtier.errors import ConfigError
from kvtier.hints import parse_retention

COUNTER = counter_for(None)


def small(**kw: Any) -> AgentsConfig:
    base: dict[str, Any] = {"sessions": 4, "turns": 4, "system_prompt_tokens": 32,
                            "context_tokens": 128, "tool_result_tokens": 16,
                            "user_message_tokens": 8, "answer_tokens": 3, "time_scale": 0.001,
                            "arrival_window_s": 0.05, "seed": 7}
    return AgentsConfig(**{**base, **kw})


def test_gaps_follow_the_traces_median_and_p90() -> None:
    rng = random.Random(1)
    draws = sorted(GapShape(17.0, 89.0).draw(rng) for _ in range(20000))
    assert statistics.median(draws) == pytest.approx(17.0, rel=0.05)
    assert draws[int(0.9 * len(draws))] == pytest.approx(89.0, rel=0.08)


def test_the_script_is_seeded_and_each_turn_extends_the_last() -> None:
    cfg = small(sessions=6, turns=5, tool_call_share=0.6)
    a, b = build(cfg, COUNTER), build(cfg, COUNTER)
    assert a == b
    assert build(small(sessions=6, turns=5, seed=8), COUNTER).sessions != a.sessions
    for s in a.sessions:
        assert s.kinds[-1] == "end" and "end" not in s.kinds[:-1]
        assert len(s.gaps_s) == cfg.turns - 1
        assert all(0 < g <= cfg.max_gap_s * cfg.time_scale for g in s.gaps_s)
        for t, kind in enumerate(s.kinds[:-1]):
            lead = "Tool result" if kind == "tool_call" else "Message"
            assert s.messages_after[t].startswith(lead)
    assert [s.start_s for s in a.sessions] == sorted(s.start_s for s in a.sessions)
    answers = ["one", "two", "three", "four"]
    for t in range(1, cfg.turns):
        before, now = a.messages(2, t - 1, answers), a.messages(2, t, answers)
        assert now[: len(before)] == before and len(now) == len(before) + 2
    assert a.messages(0, 0, [])[0]["content"] == a.messages(5, 0, [])[0]["content"]  # system
    assert a.messages(0, 0, [])[1] != a.messages(5, 0, [])[1]  # own context
    with pytest.raises(ValueError, match="needs 2 answers"):
        a.messages(0, 2, ["only one"])


def test_retention_says_what_the_answer_kind_is_worth_and_off_says_nothing() -> None:
    wl = build(small(sessions=8, turns=5, time_scale=0.05), COUNTER)
    seen = set()
    for s in wl.sessions:
        for t, kind in enumerate(s.kinds):
            assert wl.params(s.index, t, retention=False) is None
            params = wl.params(s.index, t, retention=True)
            assert params is not None
            seen.add(kind)
            if kind == "end":
                assert params == {"kvtier": {"release": True}}
                continue
            hint = parse_retention(params["kvtier"]["retention"])
            if kind == "tool_call":
                assert (hint.priority, hint.duration_s) == (90, pytest.approx(6.0))
            else:
                assert (hint.priority, hint.duration_s) == (60, pytest.approx(45.0))
    assert seen == {"tool_call", "end_of_turn", "end"}
    assert wl.after(0, 0) == "start" and wl.after(0, 1) == wl.sessions[0].kinds[0]
    with pytest.raises(ConfigError, match="priority"):
        RetentionPlan(tool_priority=101).params("tool_call", 1.0)
    assert RetentionPlan(release_at_end=False).params("end", 1.0) is None


@pytest.mark.parametrize("bad, match", [
    ({"tool_call_share": 1.5}, "tool-call-share"), ({"time_scale": 0.0}, "time-scale"),
    ({"sessions": 0}, "at least 1"), ({"context_tokens": -1}, "context-tokens"),
    ({"max_gap_s": 0.0}, "max-gap")])
def test_bad_settings_are_refused_by_name(bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        small(**bad)


def test_bad_flags_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="median"):
        GapShape(90.0, 17.0)
    with pytest.raises(ConfigError, match="allowed: on, off"):
        modes("on,maybe")
    assert modes("off, on") == ["off", "on"]
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["agents", "--out", "x", "--device-blocks", "8"])
    with pytest.raises(ConfigError, match="device-blocks"):
        engine_args(args)


def _measure(url: str, wl: Any, retention: bool, in_flight: int = 0) -> dict[str, Any]:
    return asyncio.run(measure(url, "stub-model", wl, retention, COUNTER,
                               [f"{url}/metrics"], None, 60.0, in_flight))


def test_the_same_requests_go_out_with_and_without_the_field() -> None:
    wl = build(small(), COUNTER)
    docs, bodies = {}, {}
    for mode in (True, False):
        with stub_server(StubState(accounting="cached")) as (url, state):
            docs[mode] = _measure(url, wl, mode, in_flight=1)
            bodies[mode] = list(state.bodies)
    n = 4 * 4
    for mode in (True, False):
        rows = docs[mode]["requests"]
        assert len(rows) == len(bodies[mode]) == n
        assert [r["error"] for r in rows] == [None] * n
        assert all(r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["e2e_s"] for r in rows)
        assert docs[mode]["figures"]["all_count"] == n
    with_field = [b for b in bodies[True] if "kv_transfer_params" in b]
    assert len(with_field) == n and not any("kv_transfer_params" in b for b in bodies[False])
    released = [b for b in with_field if b["kv_transfer_params"]["kvtier"].get("release")]
    assert len(released) == 4  # each session's last turn

    def strip(b: dict[str, Any]) -> str:
        return json.dumps({k: v for k, v in b.items() if k != "kv_transfer_params"},
                          sort_keys=True)
    assert sorted(map(strip, bodies[True])) == sorted(map(strip, bodies[False]))
    digests = [[r["answer_sha256"] for r in docs[m]["requests"]] for m in (True, False)]
    assert digests[0] == digests[1]
    rows = docs[True]["requests"]
    later = [r for r in rows if r["turn"] > 0]
    assert all(r["cached_tokens"] > 0 for r in later)  # the stub's prefix cache
    assert docs[True]["figures"]["after_tool_call_hit_ratio"] is None or \
        docs[True]["figures"]["after_tool_call_hit_ratio"] > 0.5
    assert docs[True]["endpoint"]["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)


def test_a_failing_turn_is_counted_and_the_session_goes_on() -> None:
    wl = build(small(sessions=2, turns=3), COUNTER)
    with stub_server(StubState(accounting="cached", ttft_s=0.0)) as (url, _state):
        asyncio.run(asyncio.sleep(0))
    doc = _measure(url, wl, True)  # the server is gone: every request fails, none raises
    assert doc["figures"]["errors"] == 6 and doc["figures"]["all_ttft_p50_s"] is None
    assert doc["endpoint"] is None


def rows_of(values: dict[str, list[tuple[float, int, int]]]) -> list[dict[str, Any]]:
    out = []
    for after, items in values.items():
        for ttft, prompt, cached in items:
            out.append({"after": after, "ttft_s": ttft, "prompt_tokens": prompt,
                        "cached_tokens": cached, "error": None})
    return out


def test_run_figures_group_turns_by_what_they_follow() -> None:
    rows = rows_of({"tool_call": [(0.1, 1000, 900), (0.3, 1000, 100)],
                    "end_of_turn": [(1.0, 2000, 0)], "start": [(2.0, 500, 0)]})
    rows.append({"after": "tool_call", "ttft_s": None, "prompt_tokens": None,
                 "cached_tokens": None, "error": "HTTP 500"})
    node = report.node_counters(
        'kvtier_evictions_total{tier="arena",cause="capacity"} 5\n'
        'kvtier_evictions_total{tier="arena",cause="other"} 2\n'
        'kvtier_retained_hits_total{tier="arena",retained="yes"} 7\n'
        "kvtier_retention_releases_total 3\n"
        'kvtier_retention_expiries_total{tier="arena"} 4\n')
    f = report.run_figures(rows, 60.0, {"prompt_tokens": 4500, "cached_tokens_by_source":
                                        {"device": 600, "host": 400},
                                        "kvtier_loaded_tokens": {"arena": 400}}, node)
    assert f["errors"] == 1 and f["requests"] == 5
    assert f["after_tool_call_ttft_p50_s"] == pytest.approx(0.2)
    assert f["after_tool_call_hit_ratio"] == pytest.approx(0.5)
    assert f["after_end_of_turn_hit_ratio"] == 0.0
    assert f["all_count"] == 4 and f["start_ttft_p99_s"] == pytest.approx(2.0)
    assert (f["host_tokens"], f["device_tokens"], f["arena_loaded_tokens"]) == (400, 600, 400)
    assert (f["arena_evictions"], f["retained_hits"], f["releases"], f["expiries"]) == (
        7, 7, 3, 4)
    assert report.node_delta({"releases": 1.0}, {"releases": 3.0}) == {"releases": 2.0}
    assert report.node_delta(None, {"releases": 3.0}) is None


def test_repeats_give_medians_and_paired_ratios(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    p50 = {"on": [0.1, 0.3, 0.2], "off": [0.4, 0.5, 0.6]}
    n = 0
    for rep in range(3):
        for mode in ("on", "off"):
            n += 1
            doc = {"run": n, "retention": mode,
                   "figures": {"after_tool_call_ttft_p50_s": p50[mode][rep], "errors": 0}}
            (runs / f"{n:03d}-{mode}.json").write_text(json.dumps(doc))
    doc = _summarize(tmp_path)
    c = doc["combined"]
    assert [r["retention"] for r in doc["runs"]] == ["on", "off"] * 3
    assert c["runs"] == {"on": 3, "off": 3}
    assert c["on"]["after_tool_call_ttft_p50_s"]["median"] == pytest.approx(0.2)
    assert c["off"]["after_tool_call_ttft_p50_s"]["max"] == pytest.approx(0.6)
    ratio = c["ratios"]["after_tool_call_ttft_p50_s"]
    assert ratio["of_medians"] == pytest.approx(0.4)
    assert ratio["paired"] == pytest.approx([0.25, 0.6, 0.3333], abs=1e-3)
    assert (tmp_path / "agents.json").is_file()
    report.print_combined(c)
    out = capsys.readouterr().out
    assert "after_tool_call_ttft_p50_s" in out and "0.40" in out and "100 ms, 300 ms" in out
