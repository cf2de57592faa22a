"""The rollout-rule parser: verdicts, binding of bare baseline, and refusal of anything else."""

from __future__ import annotations

import warnings

import pytest

from kvtier.bench.rules import RuleError, parse_rule

BASE = {"p99_ttft": 0.50, "p99_itl": 0.040, "total_tok_s": 1000.0, "errors": 0.0,
        "hit_ratio": 0.6, "missing": None}
CAND = {"p99_ttft": 0.54, "p99_itl": 0.038, "total_tok_s": 980.0, "errors": 1.0,
        "hit_ratio": 0.8, "missing": None}
KNOWN = set(BASE)


def verdict(rule: str) -> bool:
    return parse_rule(rule, KNOWN).evaluate(BASE, CAND).ok


@pytest.mark.parametrize(("rule", "ok"), [
    ("p99_ttft<=1.10*baseline", True),            # 0.54 <= 0.55
    ("p99_ttft <= 1.05 * baseline", False),       # 0.54 > 0.525
    ("total_tok_s >= 0.95 * baseline", True),     # 980 >= 950
    ("errors <= baseline.errors", False),         # 1 > 0
    ("errors <= baseline.errors + 1", True),
    ("candidate.p99_itl - baseline.p99_itl < 0", True),
    ("hit_ratio > baseline and p99_ttft < baseline", False),
    ("hit_ratio > baseline or p99_ttft < baseline", True),
    ("not (p99_ttft < baseline)", True),
    ("-p99_ttft > -1", True),
    ("(p99_ttft + p99_itl) / 2 <= 0.3", True),    # (0.54 + 0.038) / 2 = 0.289
    ("2 * 3 - 1 == 5", True),                     # precedence: * before -
    ("10 / 4 / 5 == 0.5", True),                  # left-associative
    ("p99_ttft != candidate", False),             # bare candidate: the same metric
    ("1e2 == 100", True),
])
def test_verdicts(rule: str, ok: bool) -> None:
    assert verdict(rule) is ok


def test_each_comparison_is_shown_as_evaluated() -> None:
    v = parse_rule("p99_ttft <= 1.1*baseline and errors == 0", KNOWN).evaluate(BASE, CAND)
    assert not v.ok
    assert v.steps == ("p99_ttft <= 1.1*baseline: 0.54 <= 0.55", "errors == 0: 1 == 0")


@pytest.mark.parametrize(("rule", "why"), [
    ("__import__('os')", "unexpected character \"'\""),
    ("__import__", "unknown metric '__import__'"),
    ("p99_ttft.__class__ < 1", "'.' is allowed only in baseline.NAME"),
    ("baseline.__dict__ < 1", "unknown metric '__dict__'"),
    ("baseline.and < 1", "cannot read 'baseline.and < 1' at column 10"),
    ("p99_ttft() < 1", "a call at column 1 of 'p99_ttft() < 1' is not allowed"),
    ("p99_ttft[0] < 1", "unexpected character '['"),
    ("2 ** 9999999 > 1", "powers are not supported"),
    ("1e99999999 > 1", "exponent too large"),
    ("9e300 * 9e300 > 1", "overflowed"),
    ("p99_ttft / 0 > 1", "division by zero"),
    ("(" * 50 + "1 < 2" + ")" * 50, "nested more than 20 deep"),
    ("-" * 30 + "1 < 2", "nested more than 20 deep"),
    ("not " * 30 + "1 < 2", "nested more than 20 deep"),
    ("p99_tft <= baseline", "unknown metric 'p99_tft'; did you mean p99_ttft"),
    ("p99_ttft", "is a number, not a condition"),
    ("p99_ttft <= 1.1 * baseline <= 2", "chained comparisons"),
    ("p99_ttft = 1", "unexpected character '='"),
    ("baseline <= 1", "names none"),
    ("p99_ttft <= p99_itl * baseline", "names 2"),
    ("p99_ttft and errors", "joins conditions"),
    ("(p99_ttft < 1) + 1 > 0", "needs numbers"),
    ("not p99_ttft", "'not' needs a condition"),
    ("p99_ttft <=", "ends too early"),
    ("p99_ttft < 1 )", "unexpected ')'"),
    ("(p99_ttft < 1", "expected ')'"),
    ("missing < 1", "has no value in the candidate"),
    ("x" * 401, "at most 400"),
    ("lambda: 1", "unexpected character ':'"),
    ("p99_ttft < 1; import os", "unexpected character ';'"),
])
def test_malicious_or_broken_rules_are_refused(rule: str, why: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(rule, KNOWN).evaluate(BASE, CAND)
    assert why in str(info.value)


def test_errors_name_the_column() -> None:
    with pytest.raises(RuleError, match="column 10"):
        parse_rule("p99_ttft $ 1", KNOWN)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_metric_is_refused_not_judged(bad: float) -> None:
    rule = parse_rule("not (p99_ttft > 1.1 * baseline)", KNOWN)
    with pytest.raises(RuleError, match="has no value in the candidate"):
        rule.evaluate(BASE, {**CAND, "p99_ttft": bad})


@pytest.mark.parametrize(("rule", "why"), [
    ("True < 1", "'True' is not a number"),
    ("None < 1", "'None' is not a number"),
    ("... < 1", "'...' is not a number"),
    ("0x10 < 1", "'0x10' is not a number"),
    ("1_000 < 1", "'1_000' is not a number"),
    ("1j < 1", "'1j' is not a number"),
    ("p99_ttft if 1 else 2", "'if' at column 1"),
    ("p99_ttft is 1", "'is' at column 1"),
    ("p99_ttft in p99_itl", "'in' at column 1"),
    ("p99_ttft // 2 < 1", "'//' at column 1"),
    ("p99_ttft << 2 < 1", "'<<' at column 1"),
    ("print(1)", "a call at column 1"),
    ("await p99_ttft", "'await' at column 1"),
    ("( ) < 1", "'()' with nothing inside"),
    ("baseline.p99_ttft.real < 1", "'.' is allowed only in baseline.NAME"),
    ("p99_ttft.__class__.__bases__ < 1", "'.' is allowed only in baseline.NAME"),
    ("1 .real < 2", "'.' is allowed only in baseline.NAME"),
    ("\uff50" + "99_ttft < 1", "unexpected character '\uff50' at column 1"),  # fullwidth p
    ("p99_ttft ! 1", "cannot read 'p99_ttft ! 1' at column 10"),
    ("", "the rule is empty"),
    ("   ", "the rule is empty"),
    ("p99_ttft <= baseline.p99_itl + baseline", "names 2 (p99_itl, p99_ttft)"),
])
def test_everything_off_the_whitelist_is_refused(rule: str, why: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rule(rule, KNOWN)
    assert why in str(info.value)
    if "not allowed" in str(info.value) or "unexpected character" in str(info.value):
        assert "a rule uses numbers, metric names, baseline.NAME" in str(info.value)


def test_spaces_tabs_and_newlines_separate_and_steps_keep_the_rule_as_written() -> None:
    v = parse_rule("  p99_ttft <=\n\t1.10 * baseline  ", KNOWN).evaluate(BASE, CAND)
    assert v.ok and v.steps == ("p99_ttft <=\n\t1.10 * baseline: 0.54 <= 0.55",)


def test_reading_a_rule_prints_no_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verdict("p99_ttft < 1and errors < 2") is True  # "1and": a warning
