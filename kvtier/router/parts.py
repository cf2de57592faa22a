"""The stack's parts in the router's ``/metrics`` (``kvtier route --parts-file stack.json``).

``kvtier serve --instances N`` supervises its parts (instances, the router, a local service)
and writes their states to its stack.json; a router started with ``--parts-file`` reads that
file on every scrape and exports:

=====================================  ===============================================
``kvtier_stack_part_up{part}``         1 while the part is up
``kvtier_stack_part_state{part,state}``  1 for the part's current state (``starting``, ``up``,
                                       ``restarting``, ``given up``), 0 for the others
``kvtier_stack_part_restarts_total{part}``  restarts since the stack started
=====================================  ===============================================

A file that is missing, too large or not the expected JSON exports nothing (and is not an
error: the stack rewrites it on every change).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

MAX_BYTES = 1 << 20
STATES = ("starting", "up", "restarting", "given up")


def read_parts(path: Path) -> dict[str, dict[str, Any]]:
    """The ``parts`` of a stack.json: name -> {state, restarts, ...}; {} if unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, ValueError):
        return {}
    parts = doc.get("parts") if isinstance(doc, dict) else None
    if not isinstance(parts, dict):
        return {}
    return {str(name): part for name, part in parts.items() if isinstance(part, dict)}


class PartsCollector(Collector):
    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("kvtier_stack_part_up", "1 while the stack's part is up",
                               labels=["part"])
        state = GaugeMetricFamily("kvtier_stack_part_state", "1 for the part's current state",
                                  labels=["part", "state"])
        restarts = CounterMetricFamily("kvtier_stack_part_restarts", "Restarts of the part "
                                       "since the stack started", labels=["part"])
        for name, part in sorted(read_parts(self.path).items()):
            current = part.get("state")
            up.add_metric([name], 1.0 if current == "up" else 0.0)
            for s in STATES:
                state.add_metric([name, s], 1.0 if current == s else 0.0)
            count = part.get("restarts")
            restarts.add_metric([name], float(count) if isinstance(count, int) else 0.0)
        yield from (up, state, restarts)
