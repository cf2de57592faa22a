"""Text and JSON for the trace commands: aligned tables (kvtier.tables) and figure lines;
plots live in plots.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tables import table
from kvtier.trace.analyze import Analysis, Kv
from kvtier.trace.recommend import Recommendation, TierSize
from kvtier.trace.results import SimResult, TierResult
from kvtier.trace.sizes import show_bytes, show_tokens
from kvtier.trace.stats import Summary
from kvtier.trace.sweep import BELADY, SweepPoint


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _summary_row(name: str, s: Summary, digits: int = 0) -> list[str]:
    stats = (s.mean, s.p50, s.p90, s.p99, s.max)
    return [name, num(s.count), *(num(v, digits) for v in stats)]


_SUMMARY_HEAD = ["", "count", "mean", "p50", "p90", "p99", "max"]


def analysis_text(a: Analysis) -> str:
    arr = a.arrivals
    out = [
        f"trace  {a.source} ({a.format}, {a.block_tokens}-token blocks)",
        f"requests  {arr.requests:,} over {arr.duration_s:,.1f} s: {arr.rate_per_s:.2f} req/s; "
        f"inter-arrival CV {num(arr.interarrival_cv, 2)} (1 = Poisson); peak/mean rate "
        f"{num(arr.peak_to_mean_1s, 1)} over 1 s, {num(arr.peak_to_mean_60s, 2)} over 60 s",
        "",
        table(_SUMMARY_HEAD, [
            _summary_row("input tokens", a.input_tokens),
            _summary_row("output tokens", a.output_tokens),
            _summary_row("reuse time (s)", a.reuse.reuse_time_s, 1),
            _summary_row("first reuse after creation (s)", a.reuse.first_reuse_s, 1),
            _summary_row("stack distance (tokens)", a.reuse.stack_distance_tokens),
        ], indent="  "),
        "",
        f"blocks  {a.reuse.blocks:,} unique in {a.reuse.accesses:,} accesses; never reused: "
        f"{a.reuse.never_reused:,} ({pct(a.reuse.never_reused_share)})",
        _sharing_text(a),
        "",
        f"infinite-cache prefix hit ratio  {pct(a.hits.block_hit_ratio)} of blocks, "
        f"{pct(a.hits.token_hit_ratio)} of tokens (tier sizes for a share of it: "
        "kvtier trace simulate --recommend or --sweep)",
    ]
    if a.kv is not None:
        out += ["", _kv_text(a.kv)]
    return "\n".join(out)


def _sharing_text(a: Analysis) -> str:
    buckets = [[_range(b.low, b.high), num(b.count), pct(b.share)]
               for b in a.sharing.requests_per_block]
    hot = [[h.block, num(h.blocks), show_tokens(h.prefix_tokens), num(h.requests),
            show_tokens(h.reused_tokens)] for h in a.sharing.hottest]
    return "\n".join([
        "requests sharing each block:",
        table(["requests", "blocks", "share"], buckets, indent="  "),
        "hottest shared prefixes (maximal: sharing drops after them):",
        table(["last block", "blocks", "prefix", "requests", "reused tokens"], hot,
              indent="  "),
    ])


def _range(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}-{high}"


def _kv_text(kv: Kv) -> str:
    per_request = kv.hit_bytes_per_request
    lines = [
        f"KV  {num(kv.bytes_per_token)} B/token, {show_bytes(kv.block_bytes)} per block; "
        f"footprint {show_bytes(kv.footprint_bytes)}, "
        f"of it reused {show_bytes(kv.reused_footprint_bytes)}",
        f"    infinite-cache loads: {show_bytes(kv.hit_bytes)} in all, per request "
        f"p50 {show_bytes(per_request.p50)} p99 {show_bytes(per_request.p99)}; "
        f"mean {show_bytes(kv.mean_hit_bytes_per_s)}/s, "
        f"busiest second {show_bytes(kv.peak_hit_bytes_per_s)}/s",
    ]
    if kv.load_ms_per_request is not None:
        ms = kv.load_ms_per_request
        lines.append(
            f"    at {kv.transfer_gbps:g} GB/s host transfer: load p50 {num(ms.p50, 1)} ms, "
            f"p99 {num(ms.p99, 1)} ms per request; busiest second needs "
            f"{pct(kv.peak_budget_share)} of the budget"
        )
    return "\n".join(lines)


def _capacity(chunks: int | None, block_tokens: int, bytes_per_token: int | None) -> str:
    if chunks is None:
        return "inf"
    tokens = chunks * block_tokens
    extra = f" ({show_bytes(tokens * bytes_per_token)})" if bytes_per_token else ""
    return show_tokens(tokens) + extra


def _rules(rules: tuple[tuple[str, int], ...]) -> str:
    return "+".join(f"{name}={value}" for name, value in rules) or "always"


def _moved(blocks: int, size: int | None) -> str:
    return show_bytes(size) if size is not None else f"{blocks:,} blk"


def simulation_text(result: SimResult, bytes_per_token: int | None) -> str:
    bt = result.block_tokens
    rows = [_tier_row(t, bt, bytes_per_token) for t in result.tiers]
    c = result.counts
    return "\n".join([
        table(["tier", "capacity", "eviction", "admission", "write", "hits", "hit ratio",
               "written", "read", "evictions", "unreachable"], rows, indent="  "),
        f"all tiers  block hit ratio {pct(c.block_hit_ratio)}, token hit ratio "
        f"{pct(c.token_hit_ratio)}; recomputed {num(c.recomputed_tokens)} of "
        f"{num(c.prompt_tokens)} prompt tokens",
        f"replay  {c.prompt_blocks:,} block accesses in {result.elapsed_s:.2f} s "
        f"({result.accesses_per_s:,.0f} accesses/s)",
    ])


def _tier_row(t: TierResult, bt: int, bpt: int | None) -> list[str]:
    lower = t.name != "host"
    return [t.name, _capacity(t.capacity_chunks, bt, bpt), t.eviction,
            _rules(t.admission) if lower else "-", t.write if lower else "-", num(t.hits),
            pct(t.hit_ratio), _moved(t.blocks_written, t.bytes_written),
            _moved(t.blocks_read, t.bytes_read), num(t.evictions), num(t.unreachable)]


def sweep_text(points: Sequence[SweepPoint], block_tokens: int, bpt: int | None) -> str:
    policies = list(dict.fromkeys(p.policy for p in points))
    sizes = list(dict.fromkeys(p.host_chunks for p in points))
    ratio = {(p.policy, p.host_chunks): p.block_hit_ratio for p in points}
    rows = [[_capacity(s, block_tokens, bpt), *(pct(ratio.get((pol, s))) for pol in policies)]
            for s in sizes]
    head = ["host", *(f"{p} (ceiling)" if p == BELADY else p for p in policies)]
    return "block hit ratio by host size\n" + table(head, rows, indent="  ")


def recommendation_text(rec: Recommendation, block_tokens: int, bpt: int | None) -> str:
    goal = rec.target_share * rec.achievable_block_hit_ratio
    head = (f"recommend  target {pct(rec.target_share)} of the achievable "
            f"{pct(rec.achievable_block_hit_ratio)} block hit ratio = {pct(goal)}")
    host = rec.tiers[0]
    what = f"host alone ({host.eviction})"
    lines = [head, "  " + _size_line(rec.host, what, block_tokens, bpt)]
    if rec.admission_options:
        lower = rec.tiers[1]
        given = _capacity(host.capacity, block_tokens, bpt)
        what = f"{lower.name} ({lower.eviction}, write-{lower.write}) under host {given}"
        lines.append("  " + _size_line(rec.lower, what, block_tokens, bpt))
        lines.append("  " + _admission_line(rec))
        rows = [[_rules(o.rules), pct(o.block_hit_ratio), num(o.lower_blocks_written)]
                for o in rec.admission_options]
        lines.append(table(["admission (first lower tier)", "block hits", "blocks written"],
                           rows, indent="    "))
    return "\n".join(lines)


def _size_line(size: TierSize | None, what: str, bt: int, bpt: int | None) -> str:
    if size is None:
        return f"{what}: no size reaches the target"
    return f"{what}: >= {_capacity(size.chunks, bt, bpt)}, reaching {pct(size.block_hit_ratio)}"


def _admission_line(rec: Recommendation) -> str:
    base = next(o for o in rec.admission_options if not o.rules)
    pick = rec.admission
    assert pick is not None  # options exist, so the baseline itself qualifies
    tier = rec.tiers[1].name
    if not pick.rules:
        return (f"admission on {tier}: keep admitting every block; no rule below saves writes "
                f"for at most {100 * rec.max_hit_loss:g} points of hit ratio")
    written = base.lower_blocks_written
    saved = 1 - pick.lower_blocks_written / written if written else 0.0
    loss = 100 * (base.block_hit_ratio - pick.block_hit_ratio)
    return (f"admission on {tier}: {_rules(pick.rules)} cuts its writes by {pct(saved)} for "
            f"{loss:.1f} points of hit ratio (allowed: {100 * rec.max_hit_loss:g})")


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, tuples and numpy scalars as plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def write_json(doc: dict[str, Any], path: str) -> None:
    """``path`` ``-`` writes to stdout."""
    text = json.dumps(to_jsonable(doc), indent=2) + "\n"
    if path == "-":
        print(text, end="")
    else:
        Path(path).write_text(text)
