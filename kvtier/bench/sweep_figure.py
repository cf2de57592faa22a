"""The sweep's figure, table and cliff: throughput and p99 TTFT against sessions, per config.

``cliff_ratio`` = the largest number of users at which ``arena+disk`` still holds 80% of its
peak throughput, over the number at which ``device`` has fallen to half of its own peak (the
first user count after its peak where it is at or below half). None when either never
happens in the swept range: widen ``--users``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

HOLDS = 0.8
FALLS = 0.5
Point = Mapping[str, Any]


def good_points(points: Sequence[Point], history: int | None = None) -> list[Point]:
    """Points that ran (no failure), for one history length, by users."""
    return sorted((p for p in points if p.get("error") is None and p.get("throughput_tok_s")
                   is not None and (history is None or p.get("history_tokens") == history)),
                  key=lambda p: p["users"])


def falls_to_half(points: Sequence[Point]) -> int | None:
    if not points:
        return None
    peak_at = max(range(len(points)), key=lambda i: points[i]["throughput_tok_s"])
    peak = points[peak_at]["throughput_tok_s"]
    for p in points[peak_at:]:
        if p["throughput_tok_s"] <= FALLS * peak:
            return int(p["users"])
    return None


def still_holds(points: Sequence[Point]) -> int | None:
    if not points:
        return None
    peak = max(p["throughput_tok_s"] for p in points)
    held = [int(p["users"]) for p in points if p["throughput_tok_s"] >= HOLDS * peak]
    return max(held) if held else None


def cliff(configs: Mapping[str, Mapping[str, Any]], history: int | None,
          device: str = "device", tiered: str = "arena+disk") -> dict[str, Any]:
    dev = good_points(configs.get(device, {}).get("points", []), history)
    tier = good_points(configs.get(tiered, {}).get("points", []), history)
    half, hold = falls_to_half(dev), still_holds(tier)
    return {"history_tokens": history, "device_config": device, "tiered_config": tiered,
            "device_half_users": half, "tiered_80_users": hold,
            "cliff_ratio": hold / half if half and hold else None}


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
    fig.suptitle("kvtier bench sweep: multi-round QA" +
                 (f" (cliff ratio {ratio:.1f})" if ratio else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
