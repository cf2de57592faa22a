"""A sweep point's runs, one per repeat, and what the point says: medians and their range.

A *point* is one configuration at one (users, history length); ``--repeat K`` runs it K
times, once in each repeat. ``sweep.json`` keeps every run as it was measured, and the point
carries, per figure, the median of its runs that ran, with ``min`` and ``max`` beside it::

    {"users": 8, "history_tokens": 4000,
     "throughput_tok_s": 21600.0, "p99_ttft_s": 0.31, ...        <- medians
     "min": {"throughput_tok_s": 19800.0, ...}, "max": {...},
     "requests": 72, "errors": 0,                                  <- totals over the runs
     "runs_ok": 3, "failed_runs": 0, "error": null,
     "runs": [{"repeat": 1, "invocation": 0, "throughput_tok_s": 21600.0, ...,
               "result": "points/device-h4000-u8-r1.json", "error": null}, ...]}

A failed run is kept (with its error) and left out of the medians; the point has an error
only when none of its runs ran. Everything that reads a point's figures (the cliff, the
table, the figure's lines) reads the medians; the figure's error bars read ``min``/``max``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

FIGURES = ("throughput_tok_s", "p99_ttft_s", "hit_ratio", "output_tok_s", "requests_per_s",
           "p50_ttft_s", "p99_itl_s")
"""Per-run figures a point summarizes as median, min and max."""
COUNTS = ("requests", "errors")
"""Per-run counts a point sums."""
_POINT_KEYS = ("users", "history_tokens")

Run = dict[str, Any]
Point = dict[str, Any]


def ran(run: Mapping[str, Any]) -> bool:
    """Whether a run measured something (it did not fail)."""
    return run.get("error") is None and run.get("throughput_tok_s") is not None


def summarize(users: int, history: int, runs: Sequence[Run]) -> Point:
    """The point of ``runs`` (see the module docstring): medians, range, totals, the runs."""
    runs = sorted(runs, key=lambda r: r["repeat"])
    good = [r for r in runs if ran(r)]
    point: Point = {"users": users, "history_tokens": history}
    spread: dict[str, dict[str, float | None]] = {"min": {}, "max": {}}
    for name in FIGURES:
        values = [float(r[name]) for r in good if r.get(name) is not None]
        point[name] = statistics.median(values) if values else None
        spread["min"][name] = min(values) if values else None
        spread["max"][name] = max(values) if values else None
    for name in COUNTS:
        point[name] = sum(int(r.get(name) or 0) for r in runs)
    failed = [r for r in runs if not ran(r)]
    point.update(spread)
    point.update({"runs_ok": len(good), "failed_runs": len(failed),
                  "error": None if good or not failed else failed[-1].get("error"),
                  "runs": list(runs)})
    return point


def find(points: Sequence[Point], users: int, history: int) -> Point | None:
    for p in points:
        if p["users"] == users and p["history_tokens"] == history:
            return p
    return None


def run_done(points: Sequence[Point], users: int, history: int, repeat: int,
             retry_failed: bool) -> bool:
    """Whether repeat ``repeat`` of the point has a run to keep: one that ran, or one that
    failed unless failed runs are to be retried."""
    point = find(points, users, history)
    if point is None:
        return False
    return any(r["repeat"] == repeat and (ran(r) or not retry_failed) for r in point["runs"])


def put_run(points: list[Point], users: int, history: int, run: Run) -> Point:
    """Record ``run`` (replacing an earlier run of the same repeat) and re-summarize its
    point; the points stay ordered by history length, then users."""
    old = find(points, users, history)
    runs = [r for r in (old["runs"] if old else []) if r["repeat"] != run["repeat"]]
    point = summarize(users, history, [*runs, run])
    points[:] = [p for p in points if p is not old] + [point]
    points.sort(key=lambda p: (p["history_tokens"], p["users"]))
    return point


def upgrade_v1(doc: dict[str, Any]) -> dict[str, Any]:
    """A version-1 ``sweep.json`` (one run per point, its figures on the point) as version
    2: each point becomes the point of a single run, repeat 1, so the sweep resumes and
    gains repeats."""
    for cfg in doc.get("configs", {}).values():
        points = []
        for p in cfg.get("points", []):
            run = {k: v for k, v in p.items() if k not in _POINT_KEYS}
            points.append(summarize(p["users"], p["history_tokens"],
                                    [{"repeat": 1, "invocation": None, **run}]))
        cfg["points"] = points
    doc["version"] = 2
    return doc
