"""A run's figures from its measured requests: latency percentiles, rates, goodput, hits.

- Latencies: TTFT and end-to-end per request; inter-token latencies pooled over all requests
  (every gap between two content chunks); TPOT per request ``(e2e - ttft) / (out - 1)``.
  Percentiles interpolate linearly between samples (numpy's default).
- Rates over the measured window (first measured send to last measured answer), from
  successful requests: requests/s, input (prompt) and output tokens/s, and their sum.
- Goodput: requests meeting every target (``ttft``, ``itl`` = the request's mean
  inter-token latency, ``tpot``, ``e2e``; seconds) per second and as a share of all measured
  requests (a failed request never meets them).
- The router's estimates (``kvtier route --strategy cache`` says each one in a header): the
  actual first token less the predicted, over the requests that had one (``estimate``).
- Hits: prompt tokens by where their KV came from, summed over requests that said so;
  ``hit_ratio`` is the share not recomputed. ``by_class`` groups requests by the source that
  supplied most of their prompt, with its TTFT: the quality of each tier's hits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvtier.bench.openai_client import RequestResult
from kvtier.errors import ConfigError

GOODPUT_KEYS = ("ttft", "itl", "tpot", "e2e")
STATS = ("mean", "p50", "p95", "p99", "max")
RECOMPUTED = "recomputed"


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def latency(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, **dict.fromkeys(STATS)}
    return {"count": len(values), "mean": float(np.mean(values)),
            "p50": percentile(values, 50), "p95": percentile(values, 95),
            "p99": percentile(values, 99), "max": float(max(values))}


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:2.0", "itl:0.1"]`` -> targets in seconds."""
    targets: dict[str, float] = {}
    for item in items:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep or name not in GOODPUT_KEYS:
                raise ConfigError(f"--goodput {part!r}: expected NAME:SECONDS with NAME one of "
                                  f"{', '.join(GOODPUT_KEYS)}, as in ttft:2.0")
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not seconds > 0 or seconds == float("inf"):
                raise ConfigError(f"--goodput {part!r}: the target must be a positive number "
                                  "of seconds")
            targets[name] = seconds
    return targets


def tpot(r: RequestResult) -> float | None:
    if r.ttft_s is None or not r.output_tokens or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def mean_itl(r: RequestResult) -> float | None:
    return float(np.mean(r.itl_s)) if r.itl_s else None


def meets(r: RequestResult, targets: Mapping[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "itl": mean_itl(r), "tpot": tpot(r), "e2e": r.e2e_s}
    for name, limit in targets.items():
        value = values[name]
        if value is None:
            if name == "ttft":  # not streamed: TTFT unknown, cannot be shown to be met
                return False
            continue  # a one-token answer has no inter-token gap to miss
        if value > limit:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration_s: float,
              targets: Mapping[str, float] | None = None,
              endpoint: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The run's summary (nested, for the JSON) from its measured requests."""
    ok = [r for r in results if r.ok]
    errors = Counter((r.error or "")[:80] for r in results if not r.ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens or 0 for r in ok)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    good = sum(meets(r, targets or {}) for r in results)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_rate": (len(results) - len(ok)) / len(results) if results else 0.0,
        "error_kinds": dict(errors.most_common(10)),
        "duration_s": duration_s,
        "requests_per_s": rate(len(ok)),
        "input_tokens": prompt,
        "output_tokens": output,
        "input_tok_s": rate(prompt),
        "output_tok_s": rate(output),
        "total_tok_s": rate(prompt + output),
        "ttft_s": latency([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": latency([gap for r in ok for gap in r.itl_s]),
        "e2e_s": latency([r.e2e_s for r in ok]),
        "tpot_s": latency([t for r in ok if (t := tpot(r)) is not None]),
        "goodput": {"targets": dict(targets or {}), "good": good,
                    "ratio": good / len(results) if results else 0.0,
                    "requests_per_s": rate(good)},
        "kv": kv_summary(ok, endpoint),
        "estimate": estimate_summary(ok),
        "endpoint": dict(endpoint) if endpoint else None,
    }


def estimate_summary(ok: Sequence[RequestResult]) -> dict[str, Any] | None:
    """How the router's predicted first token compared with the client's: the error
    (actual less predicted; the client's clock also counts the router's decision and the
    network) at its median and quartiles, and its absolute value at p90. None when no
    request carried an estimate."""
    pairs = [(r.ttft_s, e) for r in ok
             if r.ttft_s is not None and r.estimate
             and isinstance(e := r.estimate.get("ttft"), float)]
    if not pairs:
        return None
    errors = [actual - predicted for actual, predicted in pairs]
    return {"requests": len(pairs),
            "predicted_p50_s": percentile([p for _, p in pairs], 50),
            "actual_p50_s": percentile([a for a, _ in pairs], 50),
            "error_p25_s": percentile(errors, 25), "error_p50_s": percentile(errors, 50),
            "error_p75_s": percentile(errors, 75),
            "abs_error_p90_s": percentile([abs(e) for e in errors], 90)}


def kv_summary(ok: Sequence[RequestResult], endpoint: Mapping[str, Any] | None
               ) -> dict[str, Any]:
    told = [r for r in ok if r.kv_tokens is not None]
    sources = sorted({r.kv_source for r in told if r.kv_source})
    tokens: Counter[str] = Counter()
    for r in told:
        tokens.update(r.kv_tokens or {})
    total = sum(tokens.values())
    hit_ratio: float | None = None
    if total:
        hit_ratio = 1.0 - tokens.get(RECOMPUTED, 0) / total
    elif endpoint and endpoint.get("hit_ratio") is not None:
        hit_ratio = float(endpoint["hit_ratio"])
    return {
        "source": sources[0] if len(sources) == 1 else ("mixed" if sources else
                                                        ("endpoint" if hit_ratio is not None
                                                         else None)),
        "requests_told": len(told),
        "prompt_tokens": total,
        "tokens": dict(tokens),
        "share": {k: v / total for k, v in tokens.items()} if total else {},
        "hit_ratio": hit_ratio,
        "by_class": by_class(told),
    }


def dominant(tokens: Mapping[str, int]) -> str:
    """The source of most of a prompt's tokens (ties: the first in the mapping's order)."""
    return max(tokens, key=lambda k: tokens[k]) if tokens else RECOMPUTED


def by_class(told: Sequence[RequestResult]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestResult]] = {}
    for r in told:
        groups.setdefault(dominant(r.kv_tokens or {}), []).append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        out[name] = {"requests": len(rs), "p50_ttft_s": percentile(ttft, 50),
                     "p99_ttft_s": percentile(ttft, 99),
                     "p50_e2e_s": percentile([r.e2e_s for r in rs], 50)}
    return out


def flat(summary: Mapping[str, Any]) -> dict[str, float | None]:
    """One level of named numbers: what ``kvtier bench compare`` rules refer to."""
    out: dict[str, float | None] = {}
    for key in ("requests", "errors", "error_rate", "duration_s", "requests_per_s",
                "input_tok_s", "output_tok_s", "total_tok_s"):
        out[key] = summary[key]
    for lat in ("ttft", "itl", "e2e", "tpot"):
        for stat in STATS:
            out[f"{stat}_{lat}"] = summary[f"{lat}_s"][stat]
    out["goodput_requests_per_s"] = summary["goodput"]["requests_per_s"]
    out["goodput_ratio"] = summary["goodput"]["ratio"]
    kv = summary["kv"]
    out["hit_ratio"] = kv["hit_ratio"]
    for name, share in kv["share"].items():
        out[f"{name}_ratio" if name == RECOMPUTED else f"hit_ratio_{name}"] = share
    endpoint = summary.get("endpoint") or {}
    if endpoint.get("prompt_tokens"):
        out["endpoint_hit_ratio"] = endpoint["hit_ratio"]
        for source, n in endpoint["cached_tokens_by_source"].items():
            out[f"endpoint_hit_ratio_{source}"] = n / endpoint["prompt_tokens"]
    return out
