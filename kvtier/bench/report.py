"""Side-by-side tables for benchmark figures: kvtier, baseline, ratio."""

from __future__ import annotations

from typing import NamedTuple


class Row(NamedTuple):
    name: str
    value: float
    baseline: float | None
    baseline_name: str


def print_table(rows: list[Row], title: str = "") -> None:
    if title:
        print(title)
    width = max(len(r.name) for r in rows)
    print(f"{'':{width}}  {'kvtier':>10}  {'baseline':>10}  {'ratio':>7}  baseline")
    for r in rows:
        if r.baseline is None:
            print(f"{r.name:{width}}  {r.value:10.3f}  {'':>10}  {'':>7}")
        else:
            ratio = r.value / r.baseline if r.baseline else float("nan")
            print(f"{r.name:{width}}  {r.value:10.3f}  {r.baseline:10.3f}  {ratio:7.2f}  "
                  f"{r.baseline_name}")
