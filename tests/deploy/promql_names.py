"""What a dashboard's PromQL expression names: its metric selectors (with the labels they match
on) and the labels it groups or joins by, read from the syntax tree of ``promql-parser`` (the
Python binding of GreptimeDB's PromQL parser), so an expression Prometheus would refuse —
an unknown function, an unclosed parenthesis — fails here too.

Grafana's interval variables are replaced by a duration first; any other ``$variable`` is an
error (the dashboard defines none but its data source).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import promql_parser

GRAFANA_DURATIONS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
SYNTHETIC = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped",
                       "scrape_samples_post_metric_relabeling", "scrape_series_added"})
"""Series Prometheus makes for every target it scrapes (no exporter exports them)."""
_VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]
    """Label names its ``{...}`` matches on."""


@dataclass(frozen=True)
class Names:
    selectors: tuple[Selector, ...]
    grouping: frozenset[str]
    """Labels of ``by (...)``, ``without (...)``, ``on (...)``, ``ignoring (...)``,
    ``group_left (...)`` and ``group_right (...)``."""

    @property
    def metrics(self) -> frozenset[str]:
        return frozenset(s.metric for s in self.selectors)


def substitute(expr: str) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GRAFANA_DURATIONS:
            raise ValueError(f"unknown dashboard variable ${name} in {expr!r}")
        return GRAFANA_DURATIONS[name]

    return _VARIABLE.sub(one, expr)


def names(expr: str) -> Names:
    """ValueError when ``expr`` is not PromQL."""
    tree = promql_parser.parse(substitute(expr))
    selectors: list[Selector] = []
    grouping: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if not node.name:
                raise ValueError(f"a selector without a metric name in {expr!r}")
            matchers = list(node.matchers.matchers)
            for alternative in node.matchers.or_matchers:
                matchers.extend(alternative)
            selectors.append(Selector(node.name, frozenset(m.name for m in matchers)))
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels)

    promql_parser.walk(tree, pre_visit=visit)
    return Names(tuple(selectors), frozenset(grouping))
