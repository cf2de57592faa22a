"""The run's figures against examples computed by hand (see each test's comments)."""

from __future__ import annotations

import pytest

from kvtier.bench import prom
from kvtier.bench.figures import flat, parse_goodput, percentile, summarize
from kvtier.bench.openai_client import RequestResult
from kvtier.errors import ConfigError


def req(start: float, end: float, ttft: float | None, itl: list[float], prompt: int, out: int,
        kv: dict[str, int] | None, error: str | None = None) -> RequestResult:
    return RequestResult(user=0, round=1, warmup=False, start_s=start, end_s=end, ttft_s=ttft,
                         itl_s=itl, prompt_tokens=prompt, output_tokens=out, kv_tokens=kv,
                         kv_source="kvtier" if kv else None, error=error)


RESULTS = [
    req(0.0, 1.0, 0.2, [0.1, 0.1, 0.2], 100, 4, {"device": 60, "recomputed": 40}),
    req(0.5, 2.5, 0.6, [0.3, 0.5], 200, 3, {"arena": 150, "recomputed": 50}),
    req(1.0, 2.0, 0.4, [0.2], 100, 2, {"device": 0, "recomputed": 100}),
    req(1.5, 1.6, None, [], 0, 0, None, error="HTTP 500: boom"),
]


def test_percentiles_interpolate_linearly() -> None:
    # sorted 0.2, 0.4, 0.6: p95 sits at index 0.95 * 2 = 1.9 -> 0.4 + 0.9 * 0.2
    assert percentile([0.6, 0.2, 0.4], 95) == pytest.approx(0.58)
    assert percentile([0.6, 0.2, 0.4], 50) == pytest.approx(0.4)
    assert percentile([], 50) is None


def test_rates_and_latencies() -> None:
    s = summarize(RESULTS, duration_s=4.0)
    assert (s["requests"], s["ok"], s["errors"], s["error_rate"]) == (4, 3, 1, 0.25)
    assert s["error_kinds"] == {"HTTP 500: boom": 1}
    assert s["requests_per_s"] == pytest.approx(0.75)      # 3 ok in 4 s
    assert s["input_tok_s"] == pytest.approx(100.0)        # 400 prompt tokens
    assert s["output_tok_s"] == pytest.approx(2.25)        # 9 output tokens
    assert s["total_tok_s"] == pytest.approx(102.25)
    ttft = s["ttft_s"]
    assert ttft["count"] == 3 and ttft["mean"] == pytest.approx(0.4)
    assert ttft["p99"] == pytest.approx(0.596)             # index 1.98
    itl = s["itl_s"]                                       # pooled: .1 .1 .2 .2 .3 .5
    assert itl["count"] == 6 and itl["mean"] == pytest.approx(1.4 / 6)
    assert itl["p50"] == pytest.approx(0.2) and itl["p95"] == pytest.approx(0.45)
    assert s["e2e_s"]["p50"] == pytest.approx(1.0) and s["e2e_s"]["max"] == pytest.approx(2.0)
    # TPOT: (1.0-0.2)/3, (2.0-0.6)/2, (1.0-0.4)/1
    assert s["tpot_s"]["mean"] == pytest.approx((0.8 / 3 + 0.7 + 0.6) / 3)


def test_goodput_counts_requests_meeting_every_target() -> None:
    # r1: ttft .2, mean itl .133 -> good; r2: ttft .6 -> not; r3: ttft .4, itl .2 -> good;
    # r4 failed -> never good
    s = summarize(RESULTS, 4.0, parse_goodput(["ttft:0.5 itl:0.25"]))
    g = s["goodput"]
    assert g["good"] == 2 and g["ratio"] == pytest.approx(0.5)
    assert g["requests_per_s"] == pytest.approx(0.5)
    assert summarize(RESULTS, 4.0, {"e2e": 1.5})["goodput"]["good"] == 2


def test_hit_quality_per_tier() -> None:
    kv = summarize(RESULTS, 4.0)["kv"]
    assert kv["tokens"] == {"device": 60, "recomputed": 190, "arena": 150}
    assert kv["hit_ratio"] == pytest.approx(1 - 190 / 400)
    assert kv["share"]["arena"] == pytest.approx(0.375)
    classes = kv["by_class"]  # each request under the source of most of its prompt
    assert {k: v["requests"] for k, v in classes.items()} == {
        "device": 1, "arena": 1, "recomputed": 1}
    assert classes["arena"]["p50_ttft_s"] == pytest.approx(0.6)
    assert kv["source"] == "kvtier"


def test_flat_metrics_are_what_rules_name() -> None:
    m = flat(summarize(RESULTS, 4.0))
    assert m["p99_ttft"] == pytest.approx(0.596)
    assert m["p50_itl"] == pytest.approx(0.2)
    assert m["hit_ratio_device"] == pytest.approx(0.15)
    assert m["recomputed_ratio"] == pytest.approx(0.475)
    assert m["errors"] == 1 and m["requests_per_s"] == pytest.approx(0.75)


def test_endpoint_counters_give_hits_when_responses_say_nothing() -> None:
    before = prom.parse('vllm:prompt_tokens_total{engine="0",model_name="m"} 1000\n'
                        'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"}'
                        ' 100\n# HELP x\n')
    after = prom.parse('vllm:prompt_tokens_total{engine="0",model_name="m"} 3000\n'
                       'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"}'
                       ' 600\n'
                       'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"}'
                       ' 900\n'
                       'vllm:kvtier_loaded_tokens_total{engine="0",tier="arena"} 900\n'
                       'vllm:generation_tokens_total{engine="0"} 77\n')
    d = prom.delta(before, after)
    assert d["prompt_tokens"] == 2000
    assert d["cached_tokens_by_source"] == {"device": 500, "host": 900}
    assert d["hit_ratio"] == pytest.approx(0.7)
    assert d["kvtier_loaded_tokens"] == {"arena": 900}
    plain = [req(0, 1, 0.1, [], 10, 1, None)]
    s = summarize(plain, 1.0, endpoint=d)
    assert s["kv"]["hit_ratio"] == pytest.approx(0.7) and s["kv"]["source"] == "endpoint"
    assert flat(s)["endpoint_hit_ratio_host"] == pytest.approx(0.45)


@pytest.mark.parametrize("bad", ["ttft", "ttft:x", "ttft:-1", "latency:2", "ttft:inf"])
def test_bad_goodput_targets_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="--goodput"):
        parse_goodput([bad])
