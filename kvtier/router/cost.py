"""The ``cache`` strategy's estimate of a backend's time to first token.

::

    TTFT(b) = wait(b) + min over cuts k of [ arrival(k) + (P - k*C) / speed(b) ]

- ``wait(b)``: the prefill work queued ahead at b (:mod:`kvtier.router.load`).
- ``P`` prompt tokens, ``C`` chunk tokens; ``d`` leading chunks in b's device cache (the
  router's history), ``n`` leading chunks its node server holds (lookup), in tiers
  ``tiers[0:n]`` with ``arrival_s[0:n]`` (seconds until each could be in the arena).
- A cut ``k`` in ``[d, max(d, n)]`` loads chunks ``d..k`` and recomputes the rest, as the
  connector's load-or-recompute does; ``arrival(k)`` is the latest arrival among chunks
  ``d..k-1`` (0 for ``k = d``: device chunks cost nothing).
- ``speed(b)``: b's measured prefill tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE = "device"
RECOMPUTED = "recomputed"


@dataclass(frozen=True)
class Holding:
    """What one backend holds of a prompt."""

    device_chunks: int = 0
    tiers: tuple[str, ...] = ()
    arrival_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Prediction:
    prompt_tokens: int
    ttft_s: float
    wait_s: float
    load_s: float
    prefill_s: float
    sources: dict[str, int] = field(default_factory=dict)
    """Prompt tokens by where they would come from: device, arena, a tier, recomputed."""

    @property
    def held_tokens(self) -> int:
        return self.prompt_tokens - self.sources.get(RECOMPUTED, 0)

    @property
    def dominant(self) -> str:
        """The source of most tokens (``recomputed`` when nothing is held)."""
        return dominant(self.sources)


def estimate_header(pred: Prediction, crowd_s: float, reason: str) -> str:
    """A prediction as ``kvtier route`` reports it on the answer (``X-Kvtier-Estimate``):
    seconds to the first token and their parts (queue ahead, waiting for loads, prefill),
    the crowding counted beside it, prompt tokens held and recomputed, and the decision's
    reason. A client can set each request's actual first token against it."""
    return (f"ttft={pred.ttft_s:.4f}; wait={pred.wait_s:.4f}; load={pred.load_s:.4f}; "
            f"prefill={pred.prefill_s:.4f}; crowd={crowd_s:.4f}; held={pred.held_tokens}; "
            f"recomputed={pred.sources.get(RECOMPUTED, 0)}; reason={reason}")


def dominant(sources: dict[str, int]) -> str:
    held = {k: v for k, v in sources.items() if k != RECOMPUTED and v > 0}
    return max(held, key=lambda k: held[k]) if held else RECOMPUTED


def estimate(prompt_tokens: int, chunk_tokens: int, holding: Holding, speed: float,
             wait_s: float) -> Prediction:
    full = prompt_tokens // chunk_tokens
    d = min(holding.device_chunks, full)
    n = min(len(holding.tiers), len(holding.arrival_s), full)
    best_k, best_load = d, 0.0
    best = (prompt_tokens - d * chunk_tokens) / speed
    latest = 0.0
    for k in range(d + 1, max(d, n) + 1):
        latest = max(latest, holding.arrival_s[k - 1])
        cost = latest + (prompt_tokens - k * chunk_tokens) / speed
        if cost < best:
            best, best_k, best_load = cost, k, latest
    sources: dict[str, int] = {}
    if d:
        sources[DEVICE] = d * chunk_tokens
    for tier in holding.tiers[d:best_k]:
        sources[tier] = sources.get(tier, 0) + chunk_tokens
    sources[RECOMPUTED] = prompt_tokens - best_k * chunk_tokens
    prefill = best - best_load
    return Prediction(prompt_tokens, wait_s + best, wait_s, best_load, prefill, sources)


def lower_bound(prompt_tokens: int, chunk_tokens: int, speed: float, wait_s: float) -> float:
    """The least :func:`estimate` can give a backend whatever it holds: every whole chunk
    held with nothing to wait for, only the last partial chunk computed."""
    return wait_s + (prompt_tokens % chunk_tokens) / speed
