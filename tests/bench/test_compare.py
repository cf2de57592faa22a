"""``kvtier bench compare``: side-by-side table, verdicts and exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.compare import compare, load_metrics
from kvtier.cli import main


def results(tmp_path: Path, name: str, metrics: dict[str, float | None],
            wrapped: bool = True) -> str:
    path = tmp_path / f"{name}.json"
    doc = {"benchmark": "kvtier bench multiround", "metrics": metrics} if wrapped else metrics
    path.write_text(json.dumps(doc))
    return str(path)


BASE = {"p99_ttft": 0.8, "total_tok_s": 500.0, "errors": 0, "hit_ratio": None}
GOOD = {"p99_ttft": 0.4, "total_tok_s": 900.0, "errors": 0, "hit_ratio": 0.7}
SLOW = {"p99_ttft": 1.2, "total_tok_s": 950.0, "errors": 0, "hit_ratio": 0.7}


def test_side_by_side_with_ratios() -> None:
    out = compare(BASE, GOOD, [])
    assert out["metrics"]["p99_ttft"] == {"baseline": 0.8, "candidate": 0.4, "ratio": 0.5}
    assert out["metrics"]["hit_ratio"]["ratio"] is None  # no baseline value
    assert out["ok"] is True and out["rules"] == []


def test_a_candidate_within_its_rules_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    rc = main(["bench", "compare", results(tmp_path, "b", BASE), results(tmp_path, "c", GOOD),
               "--rule", "p99_ttft<=1.10*baseline", "--rule", "total_tok_s >= baseline"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "p99_ttft" in out and "0.500" in out and "BROKEN" not in out


def test_a_broken_rule_exits_1_and_is_named(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "verdict.json"
    rc = main(["bench", "compare", results(tmp_path, "b", BASE), results(tmp_path, "c", SLOW),
               "--rule", "p99_ttft<=1.10*baseline", "--rule", "total_tok_s >= baseline",
               "--json", str(report)])
    assert rc == 1
    captured = capsys.readouterr()
    assert "BROKEN  p99_ttft<=1.10*baseline" in captured.out
    assert "1 rule(s) broken: 'p99_ttft<=1.10*baseline'" in captured.err
    doc = json.loads(report.read_text())
    assert [r["ok"] for r in doc["rules"]] == [False, True] and doc["ok"] is False


def test_a_malicious_rule_exits_2_before_any_verdict(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "compare", results(tmp_path, "b", BASE), results(tmp_path, "c", GOOD),
               "--rule", "p99_ttft <= baseline", "--rule", "__import__('os').system('true')"])
    assert rc == 2
    captured = capsys.readouterr()
    assert "unexpected character" in captured.err and "ok    " not in captured.out


def test_flat_figure_files_are_read_too(tmp_path: Path) -> None:
    path = results(tmp_path, "ttft", {"ttft_arena_s": 0.05, "targets": "x", "flag": True},
                   wrapped=False)
    assert load_metrics(path) == {"ttft_arena_s": 0.05}


def test_unusable_files_are_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["bench", "compare", str(tmp_path / "bad.json"), str(tmp_path / "x")]) == 2
    empty = results(tmp_path, "e", {"name": "no numbers"}, wrapped=False)
    assert main(["bench", "compare", empty, empty]) == 2


def test_nan_and_infinity_in_a_results_file_are_missing(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    base = tmp_path / "b.json"
    base.write_text('{"metrics": {"p99_ttft": 0.8, "total_tok_s": 500}}')
    cand = tmp_path / "c.json"
    cand.write_text('{"metrics": {"p99_ttft": NaN, "total_tok_s": Infinity, "errors": 0}}')
    assert load_metrics(str(cand)) == {"p99_ttft": None, "total_tok_s": None, "errors": 0.0}
    # NaN would pass this rule (every comparison with NaN is false): refused instead
    assert main(["bench", "compare", str(base), str(cand),
                 "--rule", "not (p99_ttft > 1.1 * baseline)"]) == 2
    assert "has no value in the candidate" in capsys.readouterr().err
    assert main(["bench", "compare", str(base), str(cand),
                 "--rule", "total_tok_s >= baseline"]) == 2
