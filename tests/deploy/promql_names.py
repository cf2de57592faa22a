"""What a PromQL expression names: its metric selectors (with the labels they match on) and
the labels it groups or joins by. Enough of PromQL for a dashboard's queries, not a parser:
functions and aggregations are told apart from metrics by the ``(`` that follows them, and an
unknown function name is an error (so a typo cannot pass as a metric).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FUNCTIONS = frozenset({
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp",
    "floor", "histogram_quantile", "histogram_count", "histogram_sum", "histogram_fraction",
    "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln",
    "log2", "log10", "minute", "month", "predict_linear", "rate", "resets", "round", "scalar",
    "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "quantile_over_time", "stddev_over_time", "stdvar_over_time", "last_over_time",
    "present_over_time",
})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2"})
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                       "scrape_samples_post_metric_relabeling", "scrape_series_added"})
"""Series Prometheus makes for every target it scrapes (no exporter exports them)."""

_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<range>\[[^\]]*\])
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}])
  | (?P<space>\s+)
  | (?P<var>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
""", re.VERBOSE)


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]
    """Label names its ``{...}`` matches on."""


@dataclass(frozen=True)
class Names:
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]
    """Labels of ``by (...)``, ``without (...)``, ``on (...)``, ``group_left (...)``, ..."""

    @property
    def metrics(self) -> frozenset[str]:
        return frozenset(s.metric for s in self.selectors)


def tokens(expr: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "space":
            out.append((kind, m.group()))
        pos = m.end()
    return out


def names(expr: str) -> Names:
    toks = tokens(expr)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        after = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind != "name":
            i += 1
            continue
        if text in GROUPING:
            if after == "(":
                labels, i = _until_close(toks, i + 2)
                grouping.update(labels)
            else:
                i += 1
            continue
        if after in ("by", "without") and text in FUNCTIONS:
            i += 1  # an aggregation with its grouping first: sum by (x) (...)
            continue
        if after == "(":
            if text not in FUNCTIONS:
                raise ValueError(f"unknown function {text!r} in {expr!r}")
            i += 1
            continue
        if text in KEYWORDS:
            i += 1
            continue
        labels: set[str] = set()
        i += 1
        if after == "{":
            labels, i = _matchers(toks, i + 1, expr)
        selectors.append(Selector(text, frozenset(labels)))
    return Names(tuple(selectors), frozenset(grouping))


def _until_close(toks: list[tuple[str, str]], i: int) -> tuple[set[str], int]:
    found: set[str] = set()
    while toks[i][1] != ")":
        if toks[i][0] == "name":
            found.add(toks[i][1])
        i += 1
    return found, i + 1


def _matchers(toks: list[tuple[str, str]], i: int, expr: str) -> tuple[set[str], int]:
    """``label op "value", ...}`` from just after ``{``: the label names, and the index after
    ``}``."""
    found: set[str] = set()
    while toks[i][1] != "}":
        kind, text = toks[i]
        if kind == "name" and toks[i + 1][1] in ("=", "!=", "=~", "!~"):
            if toks[i + 2][0] != "string":
                raise ValueError(f"label {text!r} is not matched against a string in {expr!r}")
            found.add(text)
            i += 3
        elif text == ",":
            i += 1
        else:
            raise ValueError(f"unexpected {text!r} in a label matcher of {expr!r}")
    return found, i + 1
