"""Writing a multi-round run: the JSON document, per-request CSV, and the closing table."""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.figures import mean_itl
from kvtier.bench.openai_client import RequestResult
from kvtier.tables import table

CSV_COLUMNS = ("user", "round", "warmup", "start_s", "ttft_s", "e2e_s", "mean_itl_s",
               "max_itl_s", "prompt_tokens", "output_tokens", "kv_source", "kv_tokens",
               "backend", "estimate", "error")
_MAPPINGS = ("kv_tokens", "estimate")
"""The columns whose value is a mapping."""


def request_row(r: RequestResult) -> dict[str, Any]:
    return {
        "user": r.user, "round": r.round, "warmup": r.warmup,
        "start_s": round(r.start_s, 6), "ttft_s": _r(r.ttft_s), "e2e_s": round(r.e2e_s, 6),
        "mean_itl_s": _r(mean_itl(r)), "max_itl_s": _r(max(r.itl_s) if r.itl_s else None),
        "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
        "kv_source": r.kv_source, "kv_tokens": r.kv_tokens, "backend": r.backend,
        "estimate": r.estimate, "error": r.error,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def write_json(doc: Mapping[str, Any], path: str | Path) -> None:
    """Written to a temporary file and renamed: a reader never sees half a document."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    with os.fdopen(fd, "w") as out:
        json.dump(doc, out, indent=2, sort_keys=False, default=str)
        out.write("\n")
    os.replace(tmp, target)


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            cells = dict(row)
            for column in _MAPPINGS:  # one cell each: name=value;name=value
                pairs = cells.get(column)
                cells[column] = ";".join(f"{k}={v}" for k, v in pairs.items()) if pairs else ""
            writer.writerow(cells)


def table_rows(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, value) lines of the closing table."""
    def ms(stat: Mapping[str, Any]) -> str:
        if not stat["count"]:
            return "-"
        return " / ".join(f"{1e3 * stat[k]:.0f}" for k in ("p50", "p95", "p99"))

    rows = [
        ("requests (ok / errors)", f"{summary['ok']} / {summary['errors']}"),
        ("requests/s", f"{summary['requests_per_s']:.3f}"),
        ("tokens/s in / out", f"{summary['input_tok_s']:.0f} / {summary['output_tok_s']:.1f}"),
        ("TTFT ms p50 / p95 / p99", ms(summary["ttft_s"])),
        ("ITL ms p50 / p95 / p99", ms(summary["itl_s"])),
        ("E2E ms p50 / p95 / p99", ms(summary["e2e_s"])),
    ]
    goodput = summary["goodput"]
    if goodput["targets"]:
        targets = " ".join(f"{k}:{v:g}" for k, v in goodput["targets"].items())
        rows.append((f"goodput ({targets})", f"{goodput['requests_per_s']:.3f} req/s "
                     f"({100 * goodput['ratio']:.0f}%)"))
    kv = summary["kv"]
    if kv["hit_ratio"] is not None:
        rows.append((f"prompt KV hit ratio ({kv['source']})", f"{100 * kv['hit_ratio']:.1f}%"))
    for name, share in sorted(kv["share"].items(), key=lambda kv_: -kv_[1]):
        cls = kv["by_class"].get(name)
        ttft = (f", p50 TTFT {1e3 * cls['p50_ttft_s']:.0f} ms"
                if cls and cls["p50_ttft_s"] is not None else "")
        rows.append((f"  from {name}", f"{100 * share:.1f}%{ttft}"))
    endpoint = summary.get("endpoint") or {}
    if endpoint.get("prompt_tokens"):
        parts = [f"{k} {100 * v / endpoint['prompt_tokens']:.1f}%"
                 for k, v in endpoint["cached_tokens_by_source"].items() if v]
        rows.append(("endpoint counters: cached", ", ".join(parts) or "none"))
    for kind, n in summary["error_kinds"].items():
        rows.append((f"  error x{n}", kind))
    return rows


def print_table(summary: Mapping[str, Any], title: str) -> None:
    print(title)
    print(table(None, table_rows(summary), align="ll", indent="  "))
