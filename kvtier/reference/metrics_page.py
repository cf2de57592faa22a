"""docs/reference/metrics.md: every Prometheus metric kvtier exports, with its type, labels and
help, read from the metric objects themselves.

prometheus_client keeps a metric's label names only in a private attribute (``_labelnames``);
it is read with ``vars()`` here, and tests/test_reference.py fails if that stops working.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client.metrics import MetricWrapperBase

from kvtier.reference.markdown import code, page, prose, table


class Source(NamedTuple):
    title: str
    where: str
    collectors: Callable[[], Iterable[Any]]


def _store() -> Iterable[Any]:
    from kvtier.metrics import StoreMetrics

    return vars(StoreMetrics()).values()


def _router() -> Iterable[Any]:
    from kvtier.router.metrics import RouterMetrics

    return vars(RouterMetrics()).values()


def _parts() -> Iterable[Any]:
    from kvtier.router.parts import PartsCollector

    return PartsCollector(Path("/nonexistent/stack.json")).collect()


SOURCES = (
    Source("Node server", "`/metrics` of each node server (`kvtier server`, or the server "
           "embedded in the connector).", _store),
    Source("Router", "`/metrics` of `kvtier route`.", _router),
    Source("Stack parts", "Also on the router's `/metrics` when it runs with `--parts-file` "
           "(`kvtier serve --instances N` does so).", _parts),
)

INTRO = """\
Every metric kvtier exports, generated from its metric registries. Names are as exposed:
a counter's samples end in `_total`; a histogram's are `_bucket`, `_sum` and `_count`.
"""
_SUFFIX = {"counter": "_total"}


def render() -> str:
    return page("Metrics", INTRO, [_section(source) for source in SOURCES])


def _section(source: Source) -> str:
    rows = sorted(_rows(source.collectors()))
    return f"## {source.title}\n\n{source.where}\n\n" + table(
        ["metric", "type", "labels", "help"], rows)


def _rows(collectors: Iterable[Any]) -> Iterator[list[str]]:
    for collector in collectors:
        if isinstance(collector, MetricWrapperBase):
            labels = vars(collector)["_labelnames"]
            families = collector.describe()
        elif hasattr(collector, "documentation") and hasattr(collector, "samples"):
            labels = vars(collector)["_labelnames"]
            families = [collector]
        else:
            continue  # another attribute of the metrics object (a lock, a dict)
        for family in families:
            name = family.name + _SUFFIX.get(family.type, "")
            yield [code(name), family.type, ", ".join(code(label) for label in labels),
                   prose(family.documentation)]
