"""Side-by-side tables for benchmark figures: kvtier, baseline, ratio."""

from __future__ import annotations

from typing import NamedTuple

from kvtier.tables import table


class Row(NamedTuple):
    name: str
    value: float
    baseline: float | None
    baseline_name: str


def print_table(rows: list[Row], title: str = "") -> None:
    if title:
        print(title)
    print(table(["", "kvtier", "baseline", "ratio", "baseline"], [_cells(r) for r in rows],
                align="lrrrl"))


def _cells(r: Row) -> list[str]:
    if r.baseline is None:
        return [r.name, f"{r.value:.3f}", "", "", ""]
    ratio = r.value / r.baseline if r.baseline else float("nan")
    return [r.name, f"{r.value:.3f}", f"{r.baseline:.3f}", f"{ratio:.2f}", r.baseline_name]
