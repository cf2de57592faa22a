"""What an agents run says, and what its repeats say together.

A run's turns are grouped by what they follow: ``after_tool_call`` (the retained ones: a
tool call said "back within seconds"), ``after_end_of_turn`` (a long idle gap), ``start``
(a session's first turn, nothing to reuse but the system prompt) and ``all``. Each group has
its TTFT p50 / p99 and its hit ratio (prompt tokens vLLM took from a cache, device or
kvtier's arena, over its prompt tokens: ``usage.prompt_tokens_details.cached_tokens``).
Beside them, from the endpoint's counters over the run: prompt tokens cached by source
(``device``, ``host`` = kvtier's arena), kvtier's loads by tier, and from the node server's
page: arena evictions, releases, expiries and hits on chunks retained above the default.

Across runs (:func:`combine`): per retention mode the median of every figure with its min
and max, each repeat's on/off ratio (the i-th run of each mode paired) and the ratio of
medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.bench.figures import percentile
from kvtier.prom import samples
from kvtier.tables import table

GROUPS = ("after_tool_call", "after_end_of_turn", "start", "all")
NODE_COUNTERS = ("kvtier_evictions_total", "kvtier_retained_hits_total",
                 "kvtier_retention_releases_total", "kvtier_retention_expiries_total")
HEADLINE = ("after_tool_call_ttft_p50_s", "after_tool_call_ttft_p99_s",
            "after_tool_call_hit_ratio", "after_end_of_turn_ttft_p50_s",
            "after_end_of_turn_ttft_p99_s", "all_ttft_p50_s", "all_ttft_p99_s",
            "all_hit_ratio", "host_tokens", "device_tokens", "arena_evictions",
            "retained_hits", "errors", "duration_s")
"""The figures the closing table shows, in order."""


def in_group(row: Mapping[str, Any], group: str) -> bool:
    return group == "all" or row["after"] == group.removeprefix("after_")


def run_figures(rows: Sequence[Mapping[str, Any]], duration_s: float,
                endpoint: Mapping[str, Any] | None, node: Mapping[str, float] | None
                ) -> dict[str, float | None]:
    """One run's flat figures (seconds, ratios, token and chunk counts)."""
    ok = [r for r in rows if r["error"] is None]
    out: dict[str, float | None] = {"requests": len(rows), "errors": len(rows) - len(ok),
                                    "duration_s": round(duration_s, 3)}
    for g in GROUPS:
        mine = [r for r in ok if in_group(r, g)]
        ttft = [r["ttft_s"] for r in mine if r["ttft_s"] is not None]
        prompt = sum(r["prompt_tokens"] or 0 for r in mine)
        cached = sum(r["cached_tokens"] or 0 for r in mine)
        out[f"{g}_count"] = len(mine)
        out[f"{g}_ttft_p50_s"] = percentile(ttft, 50)
        out[f"{g}_ttft_p99_s"] = percentile(ttft, 99)
        out[f"{g}_hit_ratio"] = cached / prompt if prompt else None
    by_source = (endpoint or {}).get("cached_tokens_by_source") or {}
    out["device_tokens"] = by_source.get("device")
    out["host_tokens"] = by_source.get("host")
    out["prompt_tokens"] = (endpoint or {}).get("prompt_tokens")
    loaded = (endpoint or {}).get("kvtier_loaded_tokens") or {}
    out["arena_loaded_tokens"] = loaded.get("arena")
    for name, key in (("arena_evictions", "evictions|arena"),
                      ("retained_hits", "retained_hits|arena|yes"),
                      ("unretained_hits", "retained_hits|arena|no"),
                      ("releases", "releases"), ("expiries", "expiries|arena")):
        out[name] = None if node is None else node.get(key, 0.0)  # a counter not yet seen
    return out


def node_counters(text: str) -> dict[str, float]:
    """The node server's retention and eviction counters: ``evictions|TIER``,
    ``retained_hits|TIER|yes|no``, ``releases``, ``expiries|TIER``."""
    out: dict[str, float] = {}
    for s in samples(text, NODE_COUNTERS):
        name = s.name.removeprefix("kvtier_").removesuffix("_total")
        name = name.removeprefix("retention_")
        key = "|".join([name, *(s.labels[k] for k in ("tier", "retained") if k in s.labels)])
        out[key] = out.get(key, 0.0) + s.value
    return out


def node_delta(before: Mapping[str, float] | None, after: Mapping[str, float] | None
               ) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def combine(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians per retention mode (with min and max), each repeat's on/off ratio and the
    ratio of medians, from runs ``{"retention": "on"|"off", "figures": {...}}`` in the
    order they ran."""
    modes: dict[str, list[Mapping[str, Any]]] = {"on": [], "off": []}
    for run in runs:
        modes[run["retention"]].append(run["figures"])
    names = sorted({k for m in modes.values() for f in m for k in f})
    out: dict[str, Any] = {"runs": {m: len(v) for m, v in modes.items()}}
    for mode, figs in modes.items():
        out[mode] = {}
        for name in names:
            values = [float(f[name]) for f in figs if f.get(name) is not None]
            out[mode][name] = ({"median": statistics.median(values), "min": min(values),
                                "max": max(values), "values": values} if values else None)
    ratios: dict[str, Any] = {}
    for name in names:
        on, off = out["on"].get(name), out["off"].get(name)
        paired = [_ratio(a.get(name), b.get(name)) for a, b in zip(modes["on"], modes["off"],
                                                                  strict=False)]
        ratios[name] = {"of_medians": _ratio(on and on["median"], off and off["median"]),
                        "paired": paired}
    out["ratios"] = ratios
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(float(a) / float(b), 4)


def _fmt(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name.endswith("_s"):
        return f"{1e3 * value:.0f} ms" if name != "duration_s" else f"{value:.0f} s"
    if name.endswith("_ratio"):
        return f"{100 * value:.1f}%"
    return f"{value:.0f}"


def print_combined(doc: Mapping[str, Any]) -> None:
    """Every repeat, the medians and the on/off ratios of the headline figures."""
    both = doc["runs"]["on"] and doc["runs"]["off"]
    header = ["figure", "on (each run)", "off (each run)", "median on", "median off",
              "on/off", "paired on/off"]
    lines = []
    for name in HEADLINE:
        on, off = doc["on"].get(name), doc["off"].get(name)
        ratio = doc["ratios"].get(name, {})
        each = [", ".join(_fmt(name, v) for v in (m["values"] if m else [])) or "-"
                for m in (on, off)]
        paired = ", ".join("-" if r is None else f"{r:.2f}" for r in ratio.get("paired", []))
        lines.append((name, *each, _fmt(name, on and on["median"]),
                      _fmt(name, off and off["median"]),
                      f"{ratio['of_medians']:.2f}" if both and ratio.get("of_medians")
                      else "-", paired or "-"))
    print(table(header, lines, align="lllrrrl", indent="  "))
