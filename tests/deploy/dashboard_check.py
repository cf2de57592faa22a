"""Checking a Grafana dashboard's queries against what a running stack exports.

A scrape gives two things: the samples (each sample name with the label names it carries) and
the declared families (``# TYPE`` lines, which a labelled metric shows even before its first
sample). A query's metric must be a sample name, or a sample name of a declared family
(``X_total`` of a counter, ``X_bucket``/``X_sum``/``X_count`` of a histogram); its labels
must be on the samples, or, for a family with no sample yet, among the labels the code
declares for it (``declared_labels``).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .promql_names import SYNTHETIC, names

TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus adds to every series it scrapes."""
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                              "_created"),
             "gauge": ("",), "summary": ("_sum", "_count", "_created"), "unknown": ("",)}


@dataclass
class Exported:
    samples: dict[str, set[str]] = field(default_factory=dict)
    """Sample name -> label names seen on its samples."""
    declared: dict[str, str] = field(default_factory=dict)
    """Sample name a declared family would use -> the family."""

    def add_scrape(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for suffix in _SUFFIXES.get(family.type, ("",)):
                self.declared[family.name + suffix] = family.name
            for sample in family.samples:
                self.samples.setdefault(sample.name, set()).update(sample.labels)


def scrape(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return str(answer.read().decode())


def dashboard_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' panels included."""
    doc = json.loads(path.read_text())

    def walk(panels: Iterable[dict]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                yield panel["title"], target["expr"]

    yield from walk(doc["panels"])


@dataclass(frozen=True)
class Verdict:
    problems: tuple[str, ...]
    without_samples: frozenset[str]
    """Metrics checked against their declared family only (no sample in this scrape)."""


def check(queries: Iterable[tuple[str, str]], exported: Exported,
          declared_labels: dict[str, frozenset[str]]) -> Verdict:
    problems: list[str] = []
    unsampled: set[str] = set()
    for title, expr in queries:
        found = names(expr)
        available: set[str] = set(TARGET_LABELS)
        for sel in found.selectors:
            labels, why = _labels_of(sel.metric, exported, declared_labels)
            if labels is None:
                problems.append(f"{title}: {sel.metric} {why} ({expr})")
                continue
            if sel.metric not in exported.samples and sel.metric not in SYNTHETIC:
                unsampled.add(sel.metric)
            if sel.metric.endswith("_bucket"):
                labels = labels | {"le"}
            missing = sel.labels - labels
            if missing:
                problems.append(f"{title}: {sel.metric} has no label {sorted(missing)} "
                                f"(it has {sorted(labels)})")
            available |= labels
        stray = found.grouping - available
        if stray:
            problems.append(f"{title}: grouped by {sorted(stray)}, which none of "
                            f"{sorted(found.metrics)} carries ({expr})")
    return Verdict(tuple(problems), frozenset(unsampled))


def _labels_of(metric: str, exported: Exported, declared_labels: dict[str, frozenset[str]]
               ) -> tuple[set[str] | None, str]:
    if metric in SYNTHETIC:
        return set(TARGET_LABELS), ""
    if metric in exported.samples:
        return exported.samples[metric] | TARGET_LABELS, ""
    family = exported.declared.get(metric)
    if family is None:
        return None, "is not exported"
    if family not in declared_labels:
        return None, f"(family {family}) has no samples and no declared labels to check"
    return set(declared_labels[family]) | TARGET_LABELS, ""


def registry_labels(*objects: object) -> dict[str, frozenset[str]]:
    """Family name -> label names, from the metric objects held by ``objects`` (kvtier's
    StoreMetrics, RouterMetrics)."""
    out: dict[str, frozenset[str]] = {}
    for obj in objects:
        for metric in vars(obj).values():
            name = getattr(metric, "_name", None)
            labelnames = getattr(metric, "_labelnames", None)
            if isinstance(name, str) and labelnames is not None:
                out[name] = frozenset(labelnames)
    return out
