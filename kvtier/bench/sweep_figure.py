"""The sweep's figure, table and cliff: throughput and p99 TTFT against sessions, per config.

A point's figures are the medians of its runs (:mod:`kvtier.bench.sweep_runs`), so the cliff,
the table and the figure's lines all read medians; with repeats the table adds each median's
min-max and the figure draws it as error bars.

The cliff, per history length, from the points that ran (by users; the peak is the highest
median throughput, the first of equal ones):

- ``device_half_users``: the first user count after ``device``'s peak where its throughput is
  at or below half of the peak; None when it never is in the swept range.
- ``tiered_80_users``: the last user count before the first point after ``arena+disk``'s peak
  that is under 80% of the peak (a dip ends it, whatever comes after). When no point after
  the peak is under 80%, the largest user count swept, with ``tiered_80_users_is_lower_bound``
  set: it holds at least that far, how much further was not measured.
- ``cliff_ratio`` = ``tiered_80_users / device_half_users``; None when either is None (widen
  ``--users``); ``cliff_ratio_is_lower_bound`` when ``tiered_80_users`` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvtier.tables import table

HOLDS = 0.8
FALLS = 0.5
Point = Mapping[str, Any]


def good_points(points: Sequence[Point], history: int | None = None) -> list[Point]:
    """Points that ran (no failure), for one history length, by users."""
    return sorted((p for p in points if p.get("error") is None and p.get("throughput_tok_s")
                   is not None and (history is None or p.get("history_tokens") == history)),
                  key=lambda p: p["users"])


def _peak_at(points: Sequence[Point]) -> int:
    return max(range(len(points)), key=lambda i: points[i]["throughput_tok_s"])


def falls_to_half(points: Sequence[Point]) -> int | None:
    """The first user count after the peak at or below half of it (None: never)."""
    if not points:
        return None
    peak_at = _peak_at(points)
    peak = points[peak_at]["throughput_tok_s"]
    for p in points[peak_at:]:
        if p["throughput_tok_s"] <= FALLS * peak:
            return int(p["users"])
    return None


class Held(NamedTuple):
    users: int
    lower_bound: bool
    """No point after the peak fell under 80%: it holds at least to ``users``."""


def still_holds(points: Sequence[Point]) -> Held | None:
    """The last user count before the first point after the peak under 80% of it."""
    if not points:
        return None
    peak_at = _peak_at(points)
    peak = points[peak_at]["throughput_tok_s"]
    for before, p in zip(points[peak_at:], points[peak_at + 1:], strict=False):
        if p["throughput_tok_s"] < HOLDS * peak:
            return Held(int(before["users"]), False)
    return Held(int(points[-1]["users"]), True)


def cliff(configs: Mapping[str, Mapping[str, Any]], history: int | None,
          device: str = "device", tiered: str = "arena+disk") -> dict[str, Any]:
    dev = good_points(configs.get(device, {}).get("points", []), history)
    tier = good_points(configs.get(tiered, {}).get("points", []), history)
    half, held = falls_to_half(dev), still_holds(tier)
    ratio = held.users / half if half and held else None
    lower = held is not None and held.lower_bound
    return {"history_tokens": history, "device_config": device, "tiered_config": tiered,
            "device_half_users": half, "tiered_80_users": held.users if held else None,
            "tiered_80_users_is_lower_bound": lower,
            "cliff_ratio": ratio, "cliff_ratio_is_lower_bound": ratio is not None and lower}


def summary_line(c: Mapping[str, Any]) -> str:
    """The cliff in one line; ``≥`` marks a bound the swept range did not reach."""
    at_least = "≥" if c.get("cliff_ratio_is_lower_bound") else ""
    held = "≥" if c.get("tiered_80_users_is_lower_bound") else ""
    ratio = c["cliff_ratio"]
    return (f"cliff_ratio: {at_least}{ratio if ratio is None else f'{ratio:g}'} "
            f"(device at half its peak from {c['device_half_users']} users; "
            f"{c['tiered_config']} at 80% up to {held}{c['tiered_80_users']})")


def table_text(configs: Mapping[str, Mapping[str, Any]]) -> str:
    rows: list[list[str]] = []
    for name, c in configs.items():
        for p in sorted(c.get("points", []), key=lambda p: (p["history_tokens"], p["users"])):
            if p.get("error"):
                rows.append([name, str(p["users"]), str(p["history_tokens"]), _runs(p),
                             "failed", "-", "-", str(p["error"]).splitlines()[0][:100]])
                continue
            hit = p.get("hit_ratio")
            rows.append([name, str(p["users"]), str(p["history_tokens"]), _runs(p),
                         _cell(p, "throughput_tok_s", ".0f"), _cell(p, "p99_ttft_s", ".3f"),
                         "-" if hit is None else f"{100 * hit:.0f}%", str(p.get("errors", 0))])
    return table(["config", "users", "history", "runs", "tok/s", "p99 TTFT s", "hit",
                  "errors"], rows)


def _runs(p: Point) -> str:
    """Runs that ran, and failed ones (a version-1 point is one run)."""
    ok = p.get("runs_ok", 0 if p.get("error") else 1)
    failed = p.get("failed_runs", 1 if p.get("error") else 0)
    return f"{ok}" + (f" +{failed} failed" if failed else "")


def _cell(p: Point, name: str, fmt: str) -> str:
    """The median, and its min-max when more than one run made it."""
    value = p.get(name)
    if value is None:
        return "-"
    low, high = (p.get("min") or {}).get(name), (p.get("max") or {}).get(name)
    if p.get("runs_ok", 1) > 1 and low is not None and high is not None:
        return f"{value:{fmt}} ({low:{fmt}}-{high:{fmt}})"
    return f"{value:{fmt}}"


def error_bars(points: Sequence[Point], name: str) -> list[list[float]] | None:
    """Matplotlib's ``yerr`` for the medians of ``name``: below and above each median down
    to its min and up to its max; None when no point has more than one run."""
    if not any(p.get("runs_ok", 1) > 1 for p in points):
        return None
    below, above = [], []
    for p in points:
        value = p.get(name)
        low, high = (p.get("min") or {}).get(name), (p.get("max") or {}).get(name)
        below.append(0.0 if value is None or low is None else value - low)
        above.append(0.0 if value is None or high is None else high - value)
    return [below, above]


def plot(doc: Mapping[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(doc)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(doc: Mapping[str, Any]) -> Any:
    """Throughput and p99 TTFT against sessions: a line per configuration (and history
    length) through the medians, with min-max error bars where points have repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = doc["configs"]
    histories = sorted({p["history_tokens"] for c in configs.values() for p in c["points"]})
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":", "-."]
    for name, c in configs.items():
        for i, history in enumerate(histories):
            pts = good_points(c["points"], history)
            label = name if len(histories) == 1 else f"{name}, history {history}"
            if not pts:
                if c.get("failure"):
                    ax_tp.plot([], [], "x", label=f"{label} (failed)")
                continue
            users = [p["users"] for p in pts]
            style = styles[i % len(styles)]
            bars = ax_tp.errorbar(users, [p["throughput_tok_s"] for p in pts],
                                  yerr=error_bars(pts, "throughput_tok_s"), fmt=style,
                                  marker="o", capsize=3, label=label)
            ax_ttft.errorbar(users, [_nan(p["p99_ttft_s"]) for p in pts],
                             yerr=error_bars(pts, "p99_ttft_s"), fmt=style, marker="o",
                             capsize=3, color=bars.lines[0].get_color(), label=label)
    ax_tp.set(xlabel="sessions (users)", ylabel="throughput (tokens/s, in + out)",
              title="throughput")
    ax_ttft.set(xlabel="sessions (users)", ylabel="p99 TTFT (s)", title="p99 time to first token")
    ticks = sorted({p["users"] for c in configs.values() for p in c["points"]})
    for ax in (ax_tp, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    ax_tp.legend(fontsize=8)
    fig.suptitle(_title(doc))
    fig.tight_layout()
    return fig


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _title(doc: Mapping[str, Any]) -> str:
    ratio = doc.get("cliff_ratio")
    bound = "≥" if (doc.get("cliff") or [{}])[0].get("cliff_ratio_is_lower_bound") else ""
    counts = {p.get("runs_ok", 1) for c in doc["configs"].values() for p in good_points(
        c["points"])}
    runs = max(counts, default=1)
    median = f"median of {'up to ' if len(counts) > 1 else ''}{runs} runs (bars: min-max)"
    return ("kvtier bench sweep: multi-round QA" + (f", {median}" if runs > 1 else "") +
            (f" (cliff ratio {bound}{ratio:.1f})" if ratio else ""))
