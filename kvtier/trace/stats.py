"""Summaries of distributions, in the shape the reports and ``--json`` print them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Summary:
    """Count, mean and tail of a sample; every statistic is ``None`` for an empty sample."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


def summarize(values: np.ndarray) -> Summary:
    if len(values) == 0:
        return Summary(0, None, None, None, None, None)
    p50, p90, p99 = (float(q) for q in np.quantile(values, QUANTILES))
    return Summary(len(values), float(np.mean(values)), p50, p90, p99, float(np.max(values)))


@dataclass(frozen=True)
class Bucket:
    """Values in [low, high] (both inclusive) and their share of the whole sample."""

    low: int
    high: int
    count: int
    share: float


def power_of_two_buckets(values: np.ndarray) -> list[Bucket]:
    """Counts of positive integers in 1, 2, 3-4, 5-8, 9-16, ...; empty buckets left out."""
    if len(values) == 0:
        return []
    buckets, low, high = [], 1, 1
    top = int(values.max())
    while low <= top:
        count = int(np.count_nonzero((values >= low) & (values <= high)))
        if count:
            buckets.append(Bucket(low, high, count, count / len(values)))
        low, high = high + 1, high * 2
    return buckets
