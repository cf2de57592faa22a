"""Paired comparisons of a sweep's configurations: can it tell a win from noise?

A point's repeats run interleaved (:func:`kvtier.bench.sweep.schedule`): repeat r of every
configuration runs in one pass over the list, so what drifts slower than a pass (the
machine's speed over an hour, another tenant) moves a candidate's run and its baseline's
run of the same repeat alike. The comparison therefore divides each candidate run by the
baseline run *of the same repeat* (a paired ratio) rather than one median by the other, and
reports every ratio, their median and their range.

The verdict is what the pairs can say without a model of the noise: **better** when every
pair (at least :data:`MIN_PAIRS`) is more than :data:`LEVEL` on the better side of 1
(throughput above, p99 TTFT below), **worse** when every pair is that far on the worse side,
otherwise **within noise** (the repeats disagree, or one is level: the sweep cannot tell
them apart; more repeats may). Three pairs that agree would happen by chance one time in
four if the two were alike; five, one in sixteen: the ratios' size says how much, the
verdict only which way.

Pairs default to every configuration against the same setup's ``roundrobin`` front
(``2x-s3+cache`` against ``2x-s3+roundrobin``); ``--compare CANDIDATE:BASELINE`` names
others (the stack against the plain fleet: ``2x+cache:2x-plain+vllm-router``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvtier.bench.sweep_runs import find, ran
from kvtier.errors import ConfigError
from kvtier.tables import table

MIN_PAIRS = 3
LEVEL = 0.01
"""A ratio within this of 1 is level: it counts for neither side."""
BASELINE_FRONT = "roundrobin"
FIGURES = (("throughput_tok_s", "higher", "tok/s"), ("p99_ttft_s", "lower", "p99 TTFT"))
"""The figures compared: the name in a run, which way is better, its column."""
BETTER, WORSE, NOISE, FEW = "better", "worse", "within noise", "too few repeats"

Comparison = dict[str, Any]


def parse_pair(text: str) -> tuple[str, str]:
    """``CANDIDATE:BASELINE`` (two configuration names)."""
    candidate, sep, baseline = text.partition(":")
    if not sep or not candidate.strip() or not baseline.strip() or ":" in baseline:
        raise ConfigError(f"--compare: expected CANDIDATE:BASELINE (two configuration "
                          f"names), got {text!r}")
    return candidate.strip(), baseline.strip()


def default_pairs(names: Iterable[str]) -> list[tuple[str, str]]:
    """Every ``SETUP+FRONT`` against ``SETUP+roundrobin`` when the sweep has that one."""
    names = list(names)
    out = []
    for name in names:
        setup, plus, front = name.rpartition("+")
        base = f"{setup}+{BASELINE_FRONT}"
        if plus and front != BASELINE_FRONT and base in names:
            out.append((name, base))
    return out


def compare(configs: Mapping[str, Mapping[str, Any]],
            pairs: Sequence[tuple[str, str]]) -> list[Comparison]:
    """Each pair's paired ratios at every point both configurations have (same users and
    history). A repeat counts when both runs of it measured the figure (a failed run, or
    a baseline of 0, leaves that repeat out)."""
    for pair in pairs:
        for name in pair:
            if name not in configs:
                known = ", ".join(configs) or "none"
                raise ConfigError(f"--compare {pair[0]}:{pair[1]}: this sweep has no "
                                  f"configuration {name!r} (it has: {known})")
    out: list[Comparison] = []
    for candidate, baseline in pairs:
        base_points = configs[baseline].get("points", [])
        for point in configs[candidate].get("points", []):
            users, history = point["users"], point["history_tokens"]
            base = find(base_points, users, history)
            if base is None:
                continue
            entry: Comparison = {"candidate": candidate, "baseline": baseline,
                                 "users": users, "history_tokens": history}
            mine, theirs = _by_repeat(point), _by_repeat(base)
            for name, better, _ in FIGURES:
                entry[name] = paired(mine, theirs, name, better)
            out.append(entry)
    return out


def paired(mine: Mapping[int, Mapping[str, Any]], theirs: Mapping[int, Mapping[str, Any]],
           name: str, better: str) -> dict[str, Any]:
    """The ratios of ``name`` repeat by repeat, their median, range and verdict."""
    repeats, ratios = [], []
    for repeat in sorted(set(mine) & set(theirs)):
        a, b = mine[repeat].get(name), theirs[repeat].get(name)
        if a is None or b is None or not b > 0:
            continue
        repeats.append(repeat)
        ratios.append(float(a) / float(b))
    return {"repeats": repeats, "ratios": ratios,
            "median": statistics.median(ratios) if ratios else None,
            "min": min(ratios, default=None), "max": max(ratios, default=None),
            "verdict": verdict(ratios, better)}


def verdict(ratios: Sequence[float], better: str) -> str:
    if len(ratios) < MIN_PAIRS:
        return FEW
    up = all(r > 1.0 + LEVEL for r in ratios)
    down = all(r < 1.0 - LEVEL for r in ratios)
    if better == "higher":
        return BETTER if up else WORSE if down else NOISE
    return BETTER if down else WORSE if up else NOISE


def _by_repeat(point: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    return {int(r["repeat"]): r for r in point.get("runs", []) if ran(r)}


def table_text(comparisons: Sequence[Comparison]) -> str:
    """One line per pair and point: each figure's median ratio, every pair's, the verdict."""
    rows = []
    for c in comparisons:
        row = [f"{c['candidate']} / {c['baseline']}", str(c["users"]), str(c["history_tokens"])]
        for name, _, _ in FIGURES:
            f = c[name]
            each = ", ".join(f"{r:.2f}" for r in f["ratios"])
            row += ["-" if f["median"] is None else f"{f['median']:.2f}x ({each})",
                    f["verdict"]]
        rows.append(row)
    headers = ["candidate / baseline", "users", "history"]
    for _, _, label in FIGURES:
        headers += [label, ""]
    return table(headers, rows, align="lrrrlrl")
