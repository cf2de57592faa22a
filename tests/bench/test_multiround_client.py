"""The multi-round client against a real HTTP server on 127.0.0.1 (tests/bench/stub_server.py):
streaming and whole responses, kv_transfer_params present or absent, failures."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
from stub_server import StubState, stub_server

from kvtier.bench.multiround import Options, execute
from kvtier.bench.openai_client import (
    MAX_ESTIMATE_FIELDS,
    Endpoint,
    EndpointConfig,
    RequestSpec,
    parse_estimate,
)
from kvtier.bench.runner import LoadConfig
from kvtier.bench.workload import WorkloadConfig
from kvtier.cli import main

pytest.importorskip("httpx")


def wl(**kw: Any) -> WorkloadConfig:
    base: dict[str, Any] = {"num_users": 3, "num_rounds": 3, "system_prompt_tokens": 64,
                            "user_history_tokens": 128, "question_tokens": 16,
                            "answer_tokens": 6}
    base.update(kw)
    return WorkloadConfig(**base)


def opts(url: str, **kw: Any) -> Options:
    base: dict[str, Any] = {"url": url, "model": None, "workload": wl(),
                            "load": LoadConfig("closed", 2), "metrics_url": f"{url}/metrics"}
    base.update(kw)
    return Options(**base)


def test_streamed_run_measures_ttft_itl_and_cached_tokens() -> None:
    with stub_server(StubState(accounting="cached", ttft_s=0.03, token_s=0.01)) as (url, st):
        doc = execute(opts(url), progress=False)
    assert doc["endpoint"]["model"] == "stub-model"  # asked /v1/models
    reqs = doc["requests"]
    assert len(reqs) == 9 and all(r["error"] is None for r in reqs)
    assert all(r["ttft_s"] >= 0.03 and r["output_tokens"] == 6 for r in reqs)
    assert all(0.009 <= r["mean_itl_s"] < 0.5 for r in reqs)
    # round 0 shares only the system prompt with earlier prompts; later rounds their history
    by_round = {k: [r for r in reqs if r["round"] == k] for k in range(3)}
    assert all(r["kv_source"] == "cached_tokens" for r in reqs)
    for r in by_round[1] + by_round[2]:
        assert r["kv_tokens"]["cached"] > r["prompt_tokens"] // 2
    s = doc["summary"]
    assert s["itl_s"]["count"] == 9 * 5 and s["ttft_s"]["count"] == 9
    assert 0 < s["kv"]["hit_ratio"] < 1
    # the server's counters over the measured rounds agree with the per-request figures
    assert s["endpoint"]["prompt_tokens"] == s["kv"]["prompt_tokens"]
    assert s["endpoint"]["cached_tokens_by_source"]["device"] == s["kv"]["tokens"]["cached"]
    body = st.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6


def test_whole_responses_carry_kvtier_tiers() -> None:
    with stub_server(StubState(accounting="kvtier")) as (url, _):
        doc = execute(opts(url, stream=False), progress=False)
    reqs = doc["requests"]
    assert all(r["ttft_s"] is None and r["kv_source"] == "kvtier" for r in reqs)
    assert all(r["kv_tokens"]["arena"] > 0 for r in reqs if r["round"] > 0)
    kv = doc["summary"]["kv"]
    assert set(kv["share"]) == {"device", "arena", "recomputed"}
    assert doc["metrics"]["hit_ratio_arena"] > 0.3


def test_kv_transfer_params_on_a_streamed_chunk_are_read() -> None:
    with stub_server(StubState(accounting="kvtier", kv_on_stream=True)) as (url, _):
        doc = execute(opts(url), progress=False)
    assert all(r["kv_source"] == "kvtier" for r in doc["requests"])
    assert all(r["ttft_s"] is not None for r in doc["requests"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_the_backend_a_router_names_is_recorded_per_request(stream: bool) -> None:
    with stub_server(StubState(backend="i2")) as (url, _):
        named = execute(opts(url, stream=stream), progress=False)
    with stub_server(StubState()) as (url, _):
        unnamed = execute(opts(url, stream=stream), progress=False)
    assert [r["backend"] for r in named["requests"]] == ["i2"] * 9
    # each request's send time on the Unix clock, to line it up with the backends' logs
    assert 0 < time.time() - named["t0_unix"] - named["requests"][0]["start_s"] < 60
    assert all(r["backend"] is None for r in unnamed["requests"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_the_routers_estimate_is_kept_per_request_and_set_against_the_actual(
        stream: bool) -> None:
    said = ("ttft=0.0100; wait=0.0000; load=0.0020; prefill=0.0080; crowd=0.0310; held=512; "
            "recomputed=16; reason=affinity")
    with stub_server(StubState(estimate=said, ttft_s=0.05)) as (url, _):
        doc = execute(opts(url, stream=stream), progress=False)
    assert all(r["estimate"] == {"ttft": 0.01, "wait": 0.0, "load": 0.002, "prefill": 0.008,
                                 "crowd": 0.031, "held": 512.0, "recomputed": 16.0,
                                 "reason": "affinity"} for r in doc["requests"])
    est = doc["summary"]["estimate"]
    if not stream:  # a whole answer has no first token to set against it
        assert est is None
        return
    assert est["requests"] == 9 and est["predicted_p50_s"] == pytest.approx(0.01)
    # the stub answers 0.05 s late at the least: the router's estimate was that much short
    assert est["error_p25_s"] >= 0.035 and est["error_p50_s"] >= 0.035
    assert est["abs_error_p90_s"] >= est["error_p50_s"]


def test_an_estimate_header_not_of_its_form_is_refused_and_a_long_one_cut() -> None:
    for said in ("", "ttft", "=1", "ttft=1; wait", "two words=1", "ttft=" + "1" * 65, ";"):
        assert parse_estimate(said) is None, said
    assert parse_estimate(" ttft = nan ; reason=x; ") == {"ttft": "nan", "reason": "x"}, \
        "no number that is not finite; spaces and a trailing separator are fine"
    many = parse_estimate("; ".join(f"f{i}={i}" for i in range(40)))
    assert many == {f"f{i}": float(i) for i in range(MAX_ESTIMATE_FIELDS)}


def test_an_endpoint_that_says_nothing_leaves_hits_unknown() -> None:
    with stub_server(StubState(accounting="none")) as (url, _):
        doc = execute(opts(url, metrics_url=None), progress=False)
    assert all(r["kv_source"] is None for r in doc["requests"])
    assert doc["summary"]["kv"]["hit_ratio"] is None
    assert doc["metrics"]["hit_ratio"] is None


def test_failures_are_recorded_and_the_conversation_goes_on() -> None:
    failures = {(1, 0): "http500", (2, 1): "midstream"}
    with stub_server(StubState(failures=failures)) as (url, st):
        doc = execute(opts(url), progress=False)
    errors = {(r["user"], r["round"]): r["error"] for r in doc["requests"] if r["error"]}
    assert set(errors) == {(1, 0), (2, 1)}
    assert errors[(1, 0)].startswith("HTTP 500") and "mid-stream" in errors[(2, 1)]
    assert doc["summary"]["errors"] == 2 and doc["summary"]["ok"] == 7
    # user 1 still spoke in rounds 1 and 2, with a stand-in for the failed answer
    later = [b for b in st.bodies if "Question 3 from user 1:" in b["messages"][-1]["content"]]
    assert len(later) == 1 and len(later[0]["messages"]) == 1 + 2 * 2 + 1
    stand_in, real = later[0]["messages"][2]["content"], later[0]["messages"][4]["content"]
    assert stand_in and " w0" not in stand_in and real == " w0 w1 w2 w3 w4 w5"


def test_warmup_rounds_are_left_out_of_the_figures() -> None:
    with stub_server() as (url, st):
        doc = execute(opts(url, workload=wl(warmup_rounds=1)), progress=False)
    assert len(st.bodies) == 9
    assert doc["summary"]["requests"] == 6
    assert all(r["warmup"] == (r["round"] == 0) for r in doc["requests"])
    # the endpoint's counters cover the measured rounds only
    measured_prompt = sum(r["prompt_tokens"] for r in doc["requests"] if not r["warmup"])
    assert doc["summary"]["endpoint"]["prompt_tokens"] == measured_prompt


def test_open_loop_sends_at_the_requested_rate() -> None:
    with stub_server(StubState(ttft_s=0.001, token_s=0.001)) as (url, _):
        doc = execute(opts(url, workload=wl(num_users=4, num_rounds=2),
                           load=LoadConfig("open", 0, qps=40.0, seed=3)), progress=False)
    starts = sorted(r["start_s"] for r in doc["requests"])
    span = starts[-1] - starts[0]
    assert 0.02 < span < 2.0  # 7 Poisson gaps at 40/s: about 0.18 s
    assert doc["load"]["mode"] == "open" and doc["summary"]["ok"] == 8


def test_closed_loop_keeps_at_most_concurrency_in_flight() -> None:
    with stub_server(StubState(ttft_s=0.05, token_s=0.0)) as (url, _):
        doc = execute(opts(url, workload=wl(num_users=4, num_rounds=1),
                           load=LoadConfig("closed", 2)), progress=False)
    spans = sorted((r["start_s"], r["start_s"] + r["e2e_s"]) for r in doc["requests"])
    for start, _end in spans:
        assert sum(s <= start < e for s, e in spans) <= 2


@pytest.mark.parametrize("stream", [True, False])
def test_closed_loop_clients_start_one_after_another(stream: bool) -> None:
    # all at once, equal prompts would keep the clients in step for several turns; each
    # starts once the one before it has its first token (unstreamed: its answer), in both
    # phases; streamed, all are then in flight (an answer takes longer than the ramp)
    state = StubState(ttft_s=0.08, token_s=0.1)
    with stub_server(state) as (url, _):
        doc = execute(opts(url, workload=wl(num_users=4, num_rounds=3, warmup_rounds=1),
                           load=LoadConfig("closed", 4), stream=stream), progress=False)
    assert doc["summary"]["ok"] == 8
    for warmup in (True, False):
        reqs = sorted((r for r in doc["requests"] if r["warmup"] == warmup),
                      key=lambda r: r["start_s"])
        if not stream:
            assert reqs[1]["start_s"] >= reqs[0]["start_s"] + 0.9 * reqs[0]["e2e_s"]
            continue
        for before, after in itertools.pairwise(reqs[:4]):
            assert after["start_s"] >= before["start_s"] + 0.9 * before["ttft_s"]
        fourth = reqs[3]["start_s"]
        assert sum(r["start_s"] <= fourth < r["start_s"] + r["e2e_s"] for r in reqs) == 4


def test_api_key_and_user_header_are_sent(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sekrit\n")

    async def one(url: str) -> None:
        ep = Endpoint(EndpointConfig(url=url, model="m", api="completions", api_key="sekrit",
                                     user_header="x-user-id"))
        try:
            r = await ep.send(RequestSpec(5, 0, False, 3, prompt="Question 1 from user 5: hi"))
        finally:
            await ep.close()
        assert r.ok and r.output_tokens == 3 and r.ttft_s is not None

    with stub_server() as (url, st):
        asyncio.run(one(url))
    headers = {k.lower(): v for k, v in st.headers[0].items()}
    assert headers["authorization"] == "Bearer sekrit" and headers["x-user-id"] == "5"
    assert st.bodies[0]["prompt"].startswith("Question 1")


def test_command_line_writes_json_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    out, table = tmp_path / "run.json", tmp_path / "run.csv"
    with stub_server(StubState(estimate="ttft=0.02; held=64; reason=affinity")) as (url, _):
        rc = main(["bench", "multiround", "--url", url, "--num-users", "2", "--num-rounds", "2",
                   "--shared-system-prompt", "32", "--user-history-prompt", "64",
                   "--answer-len", "4", "--goodput", "ttft:5", "itl:1", "--json", str(out),
                   "--csv", str(table), "--no-progress", "--api", "completions"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["metrics"]["goodput_ratio"] == 1.0 and doc["endpoint"]["api"] == "completions"
    rows = list(csv.DictReader(table.open()))
    assert len(rows) == 4 and rows[0]["user"] == "0" and "cached=" in rows[-1]["kv_tokens"]
    assert rows[0]["estimate"] == "ttft=0.02;held=64.0;reason=affinity"
    printed = capsys.readouterr().out
    assert "TTFT ms p50 / p95 / p99" in printed and "goodput" in printed


def test_api_key_never_lands_in_the_results(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_KEY", "do-not-write-me")
    out = tmp_path / "run.json"
    with stub_server() as (url, _):
        main(["bench", "multiround", "--url", url, "--num-users", "1", "--num-rounds", "1",
              "--shared-system-prompt", "8", "--user-history-prompt", "8", "--answer-len", "2",
              "--api-key-env", "KVTIER_TEST_KEY", "--json", str(out), "--no-progress"])
    assert "do-not-write-me" not in out.read_text()
