"""A few named samples out of a scraped ``/metrics`` page (Prometheus text exposition).

Both readers of other processes' counters use this: the router (a backend's queue and device
cache size, :mod:`kvtier.router.scrape`) and the benchmarks (an endpoint's token counters,
:mod:`kvtier.bench.prom`). Parsing is ``prometheus_client``'s; this module only picks the
lines that name a wanted series first, so a page of thousands of histogram buckets costs little,
and keeps a scraped page from doing harm: the page may come from a broken or hostile server, so
only its first :data:`MAX_CHARS` characters and :data:`MAX_LINES` wanted lines are read, and a
line the parser refuses is skipped, not raised — what the rest of the page says still counts.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

MAX_CHARS = 8 << 20
MAX_LINES = 4096


class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def samples(text: str, names: Collection[str]) -> list[Sample]:
    """The samples of the series in ``names`` (full sample names, ``_total`` included)."""
    if len(text) > MAX_CHARS:  # cut at a line's end: a number cut short would be wrong
        text = text[:text.rfind("\n", 0, MAX_CHARS) + 1]
    prefixes = tuple(names)
    wanted = [line for line in text.splitlines() if line.startswith(prefixes)][:MAX_LINES]
    try:
        found = _parse("\n".join(wanted))
    except ValueError:  # one bad line spoils a whole parse: take the lines one by one
        found = []
        for line in wanted:
            try:
                found += _parse(line)
            except ValueError:
                continue
    return [s for s in found if s.name in names]


def _parse(text: str) -> list[Sample]:
    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]
