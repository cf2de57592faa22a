"""The sweep's figure, table and cliff: throughput and p99 TTFT against sessions, per config.

The cliff, per history length, from the points that ran (by users; the peak is the highest
throughput, the first of equal ones):

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
    rows = [["config", "users", "history", "tok/s", "p99 TTFT s", "hit", "errors"]]
    for name, c in configs.items():
        for p in sorted(c.get("points", []), key=lambda p: (p["history_tokens"], p["users"])):
            if p.get("error"):
                rows.append([name, str(p["users"]), str(p["history_tokens"]), "failed",
                             "-", "-", str(p["error"]).splitlines()[0][:100]])
                continue
            hit = p.get("hit_ratio")
            ttft = p.get("p99_ttft_s")
            rows.append([name, str(p["users"]), str(p["history_tokens"]),
                         f"{p['throughput_tok_s']:.0f}", "-" if ttft is None else f"{ttft:.3f}",
                         "-" if hit is None else f"{100 * hit:.0f}%", str(p.get("errors", 0))])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def plot(doc: Mapping[str, Any], path: str) -> None:
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
            (line,) = ax_tp.plot(users, [p["throughput_tok_s"] for p in pts], style, marker="o",
                                 label=label)
            ax_ttft.plot(users, [p["p99_ttft_s"] for p in pts], style, marker="o",
                         color=line.get_color(), label=label)
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
    ratio = doc.get("cliff_ratio")
    bound = "≥" if (doc.get("cliff") or [{}])[0].get("cliff_ratio_is_lower_bound") else ""
    fig.suptitle("kvtier bench sweep: multi-round QA" +
                 (f" (cliff ratio {bound}{ratio:.1f})" if ratio else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
