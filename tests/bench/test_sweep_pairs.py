"""Paired comparisons (:mod:`kvtier.bench.sweep_pairs`): run by run of each repeat, the
verdict only what every repeat agrees on, failed runs and missing points left out, and the
committed fleet sweep's hand-made tables reproduced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import sweep_pairs
from kvtier.bench.sweep_pairs import (
    BETTER,
    FEW,
    NOISE,
    WORSE,
    compare,
    default_pairs,
    parse_pair,
    verdict,
)
from kvtier.errors import ConfigError

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def point(tputs: list[float | None], p99s: list[float | None] | None = None,
          users: int = 8, history: int = 4000) -> dict[str, Any]:
    p99s = p99s or [None if t is None else 100.0 / t for t in tputs]
    runs = [{"repeat": i + 1, "throughput_tok_s": t, "p99_ttft_s": p,
             "error": None if t is not None else "every request failed"}
            for i, (t, p) in enumerate(zip(tputs, p99s, strict=True))]
    return {"users": users, "history_tokens": history, "runs": runs}


def configs(**points: list[dict[str, Any]]) -> dict[str, Any]:
    return {name.replace("_", "+"): {"points": p} for name, p in points.items()}


def test_verdicts_need_every_repeat_on_one_side_beyond_level() -> None:
    assert verdict([1.2, 1.1, 1.05], "higher") == BETTER
    assert verdict([0.8, 0.9, 0.95], "higher") == WORSE
    assert verdict([0.8, 0.9, 0.95], "lower") == BETTER
    assert verdict([1.2, 1.1, 0.95], "higher") == NOISE
    assert verdict([1.2, 1.1, 1.005], "higher") == NOISE, "a level pair says nothing"
    assert verdict([1.2, 1.3], "higher") == FEW
    assert verdict([], "lower") == FEW


def test_runs_are_paired_by_repeat_not_by_order_and_failed_runs_left_out() -> None:
    cand = point([1100.0, None, 1300.0, 900.0])
    base = point([1000.0, 1000.0, 1000.0, 1000.0])
    base["runs"].reverse()  # order in the file must not matter
    cand["runs"][0]["repeat"], cand["runs"][2]["repeat"] = 3, 1  # 1300 is repeat 1
    (c,) = compare(configs(s_cache=[cand], s_roundrobin=[base]),
                   [("s+cache", "s+roundrobin")])
    tput = c["throughput_tok_s"]
    assert tput["repeats"] == [1, 3, 4], "repeat 2 failed: left out"
    assert tput["ratios"] == pytest.approx([1.3, 1.1, 0.9])
    assert tput["median"] == pytest.approx(1.1) and tput["min"] == pytest.approx(0.9)
    assert tput["verdict"] == NOISE
    assert c["p99_ttft_s"]["ratios"] == pytest.approx([1 / 1.3, 1 / 1.1, 1 / 0.9])
    assert (c["candidate"], c["baseline"], c["users"]) == ("s+cache", "s+roundrobin", 8)


def test_points_only_one_side_has_and_a_zero_baseline_are_skipped() -> None:
    cand = [point([1.0, 1.0, 1.0], users=8), point([2.0, 2.0, 2.0], users=16)]
    base = [point([0.5, 0.5, 0.5], p99s=[0.0, 1.0, 1.0], users=8)]
    (c,) = compare(configs(s_cache=cand, s_roundrobin=base), [("s+cache", "s+roundrobin")])
    assert c["users"] == 8 and c["throughput_tok_s"]["verdict"] == BETTER
    assert c["p99_ttft_s"]["repeats"] == [2, 3] and c["p99_ttft_s"]["verdict"] == FEW


def test_default_pairs_are_each_front_against_its_setups_round_robin() -> None:
    names = ["2x+roundrobin", "2x+cache", "2x+vllm-router", "2x-s3+cache",
             "2x-s3+roundrobin", "2x-noshare+cache", "2x-plain+vllm-router", "device"]
    assert default_pairs(names) == [("2x+cache", "2x+roundrobin"),
                                    ("2x+vllm-router", "2x+roundrobin"),
                                    ("2x-s3+cache", "2x-s3+roundrobin")]


@pytest.mark.parametrize("text", ["2x+cache", ":2x+roundrobin", "2x+cache:", " : ",
                                  "a:b:c"])
def test_a_malformed_compare_flag_is_refused_naming_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match="CANDIDATE:BASELINE"):
        parse_pair(text)


def test_an_unknown_configuration_is_refused_naming_those_there_are() -> None:
    with pytest.raises(ConfigError, match=r"no configuration '2x\+nope'.*s\+cache"):
        compare(configs(s_cache=[point([1.0])]), [("2x+nope", "s+cache")])


def test_the_committed_fleet_sweep_gives_its_readmes_figures() -> None:
    """docs/results/fleet-64-settle/README.md's paired table was made by hand: the same
    ratios, repeat by repeat, come out of the sweep's own JSON."""
    doc = json.loads((RESULTS / "fleet-64-settle" / "sweep.json").read_text())
    pairs = [*default_pairs(doc["configs"]), ("2x-noshare+cache", "2x-noshare+vllm-router")]
    got = {(c["candidate"], c["baseline"]): c for c in compare(doc["configs"], pairs)}
    noshare = got[("2x-noshare+cache", "2x-noshare+roundrobin")]
    assert [round(r, 2) for r in noshare["throughput_tok_s"]["ratios"]] == [1.52, 1.53, 1.41]
    assert [round(r, 2) for r in noshare["p99_ttft_s"]["ratios"]] == [0.33, 0.28, 0.47]
    assert noshare["throughput_tok_s"]["verdict"] == noshare["p99_ttft_s"]["verdict"] == BETTER
    s3 = got[("2x-s3+cache", "2x-s3+roundrobin")]
    assert round(s3["throughput_tok_s"]["median"], 2) == 1.21
    assert s3["p99_ttft_s"]["verdict"] == NOISE, "0.94, 1.29, 0.98: the repeats disagree"
    table = sweep_pairs.table_text(list(got.values()))
    assert "1.52x (1.52, 1.53, 1.41)" in table and "within noise" in table
