"""PNG figures (matplotlib, Agg backend, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import BackendUnavailableError
from kvtier.trace.analyze import Distributions
from kvtier.trace.sweep import BELADY, SweepPoint


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise BackendUnavailableError(
            "--plot needs matplotlib; install it with: pip install 'kvtier[plot]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: np.ndarray, label: str, xlabel: str) -> None:
    finite = np.sort(values[np.isfinite(values)])
    if len(finite) == 0:
        ax.set_title(f"{label}: no samples")
        return
    ax.plot(finite, np.arange(1, len(finite) + 1) / len(finite))
    if finite[0] > 0:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share")
    ax.set_title(label)
    ax.grid(alpha=0.3)


def plot_analysis(d: Distributions, path: str, title: str) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    _arrivals(axes[0][0], d.arrival_s)
    _cdf(axes[0][1], d.input_tokens.astype(float), "prompt length", "tokens")
    _sharing(axes[0][2], d.requests_per_block)
    _cdf(axes[1][0], d.reuse_time_s[d.reuse_time_s > 0], "reuse time (reuses > 0 s)", "seconds")
    _cdf(axes[1][1], d.first_reuse_s[d.first_reuse_s > 0], "first reuse after creation",
         "seconds (how long a tier must keep a new block)")
    _cdf(axes[1][2], d.stack_distance_tokens.astype(float), "stack distance of reuses",
         "tokens (distinct blocks used in between)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _arrivals(ax: Any, ts: np.ndarray) -> None:
    rel = ts - ts.min()
    bins = max(1, min(200, int(rel.max() // 10) + 1))
    counts, edges = np.histogram(rel, bins=bins)
    width = float(edges[1] - edges[0]) or 1.0
    ax.plot(edges[:-1], counts / width)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("requests/s")
    ax.set_title("arrival rate")
    ax.grid(alpha=0.3)


def _sharing(ax: Any, counts: np.ndarray) -> None:
    values, freq = np.unique(counts, return_counts=True)
    ax.loglog(values, freq, "o", markersize=3)
    ax.set_xlabel("requests sharing a block")
    ax.set_ylabel("blocks")
    ax.set_title("prefix sharing")
    ax.grid(alpha=0.3)


def plot_sweep(points: Sequence[SweepPoint], block_tokens: int, path: str, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    finite = [p for p in points if p.host_chunks is not None]
    for policy in dict.fromkeys(p.policy for p in finite):
        line = sorted((p for p in finite if p.policy == policy), key=lambda p: p.host_chunks or 0)
        x = [(p.host_chunks or 0) * block_tokens for p in line]
        y = [p.block_hit_ratio for p in line]
        style = {"linestyle": "--", "color": "black"} if policy == BELADY else {"marker": "o"}
        ax.semilogx(x, y, label=f"{policy} (offline optimum)" if policy == BELADY else policy,
                    **style)
    unbounded = [p.block_hit_ratio for p in points if p.host_chunks is None]
    if unbounded:
        ax.axhline(max(unbounded), color="grey", linestyle=":", label="infinite cache")
    ax.set_xlabel("host size (tokens)")
    ax.set_ylabel("block prefix hit ratio")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
