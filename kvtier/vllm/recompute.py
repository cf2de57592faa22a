"""Load or recompute: a hit is worth loading only if it arrives before its recompute would end.

The server estimates, per chunk of a hit, when it could be in the arena (arena chunks at
once; lower-tier chunks after the tier's measured read time, queue included). The engine
side knows how fast it prefills (:class:`PrefillMeter`). A hit is a prefix, so the choice is
where to cut it::

    gain(k) = recompute time of the first k chunks' tokens - arrival of the slowest of them
    k*      = argmax gain(k)       (0 when nothing pays); chunks past k* are recomputed

and the tokens past the cut are counted as ``skipped_slower_than_recompute`` for the tier
they would have come from. With no measured prefill speed yet, everything is loaded.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    tiers: list[str]
    """The hit's tiers up to the cut (what is loaded)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Tokens past the cut by the tier they would have come from."""


def choose(tiers: list[str], arrival_s: list[float], *, start_chunk: int, local_tokens: int,
           chunk_tokens: int, prefill_tokens_per_s: float | None) -> Choice:
    """Where to cut the hit ``tiers`` (chunks ``start_chunk`` on); see the module docstring."""
    if not tiers or not prefill_tokens_per_s or len(arrival_s) != len(tiers):
        return Choice(list(tiers))
    best_k, best_gain, slowest = 0, 0.0, 0.0
    for i, arrival in enumerate(arrival_s):
        slowest = max(slowest, arrival)
        tokens = (start_chunk + i + 1) * chunk_tokens - local_tokens
        gain = tokens / prefill_tokens_per_s - slowest
        if gain > best_gain:
            best_k, best_gain = i + 1, gain
    skipped: dict[str, int] = {}
    for i in range(best_k, len(tiers)):
        tokens = chunk_tokens - max(0, local_tokens - (start_chunk + i) * chunk_tokens)
        skipped[tiers[i]] = skipped.get(tiers[i], 0) + tokens
    return Choice(list(tiers[:best_k]), skipped)


class PrefillMeter:
    """How many prompt tokens per second this engine computes, measured from its steps.

    The time from one step's plan to the next is that step's duration (the engine plans
    the next step when the last one is done); steps that computed at least ``min_tokens``
    give a sample. The median of the last samples keeps out gaps where the engine idled
    between two steps (those would make recompute look slow, never fast).
    """

    def __init__(self, min_tokens: int, window: int = 16, max_gap_s: float = 60.0) -> None:
        self.min_tokens = min_tokens
        self.max_gap_s = max_gap_s
        self._samples: deque[float] = deque(maxlen=window)
        self._last: tuple[float, int] | None = None

    def step(self, now: float, tokens: int) -> None:
        """A step was planned at ``now`` that computes ``tokens`` tokens."""
        if self._last is not None:
            started, computed = self._last
            gap = now - started
            if computed >= self.min_tokens and 0 < gap <= self.max_gap_s:
                self._samples.append(computed / gap)
        self._last = (now, tokens) if tokens else None

    def tokens_per_s(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None
