"""The recommendation: smallest tier sizes for a share of the achievable hit ratio, and the
admission rule that saves the most lower-tier writes for an affordable hit-ratio loss.

"Achievable" is the infinite-cache prefix hit ratio. Sizes are found by replaying the trace
at sizes closing in geometrically until they are within 2%, for every policy: with the store's
tail-first order even LRU has no exact one-pass curve (see :mod:`kvtier.trace.reuse`). The
search assumes the hit ratio grows with size, which nearly always holds but is not guaranteed
for any of the policies (a request longer than the host can hit less in a larger one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.trace.formats import Trace
from kvtier.trace.results import SimResult
from kvtier.trace.simulate import HOST, TierSpec, simulate

PRECISION = 1.02


@dataclass(frozen=True)
class TierSize:
    tier: str
    chunks: int
    block_hit_ratio: float


@dataclass(frozen=True)
class AdmissionOption:
    rules: tuple[tuple[str, int], ...]
    block_hit_ratio: float
    lower_blocks_written: int


@dataclass(frozen=True)
class Recommendation:
    target_share: float
    achievable_block_hit_ratio: float
    tiers: tuple[TierSpec, ...]
    """The configuration the sizes and rules were searched around."""
    host: TierSize | None
    """None when even a host holding every block misses the target."""
    lower: TierSize | None
    admission: AdmissionOption | None
    admission_options: list[AdmissionOption]
    max_hit_loss: float


def recommend(
    trace: Trace, specs: Sequence[TierSpec], target_share: float = 0.9, max_hit_loss: float = 0.01
) -> Recommendation:
    """Size the host alone, then the first lower tier under the given host, then admission."""
    achievable = simulate(trace.requests, [TierSpec(HOST, None)], trace.block_tokens)
    goal = target_share * achievable.block_hit_ratio
    options = admission_options(trace, specs) if len(specs) > 1 else []
    return Recommendation(
        target_share=target_share,
        achievable_block_hit_ratio=achievable.block_hit_ratio,
        tiers=tuple(specs),
        host=host_size(trace, specs[0], goal),
        lower=lower_size(trace, specs, goal) if len(specs) > 1 else None,
        admission=pick_admission(options, max_hit_loss),
        admission_options=options,
        max_hit_loss=max_hit_loss,
    )


def host_size(trace: Trace, host: TierSpec, goal: float) -> TierSize | None:
    """The smallest host alone (with ``host``'s policy) whose block hit ratio reaches ``goal``."""

    def ratio(chunks: int) -> float:
        spec = dataclasses.replace(host, capacity=chunks)
        return _replay(trace, [spec]).block_hit_ratio

    return _smallest(HOST, ratio, goal, _unique_blocks(trace))


def lower_size(trace: Trace, specs: Sequence[TierSpec], goal: float) -> TierSize | None:
    """The smallest first lower tier that, under the given host, reaches ``goal``."""
    lower = specs[1]

    def ratio(chunks: int) -> float:
        resized = [specs[0], dataclasses.replace(lower, capacity=chunks), *specs[2:]]
        return _replay(trace, resized).block_hit_ratio

    without = ratio(0)
    if without >= goal:
        return TierSize(lower.name, 0, without)
    return _smallest(lower.name, ratio, goal, _unique_blocks(trace))


def admission_options(trace: Trace, specs: Sequence[TierSpec]) -> list[AdmissionOption]:
    """The configured tiers replayed with each candidate rule set on the first lower tier."""
    bt = trace.block_tokens
    candidates: list[tuple[tuple[str, int], ...]] = [
        (),
        (("after_uses", 2),),
        (("after_uses", 3),),
        (("min_prefix_tokens", 4 * bt),),
        (("after_uses", 2), ("min_prefix_tokens", 4 * bt)),
    ]
    options = []
    for rules in candidates:
        tiers = [specs[0], dataclasses.replace(specs[1], admission=rules), *specs[2:]]
        result = _replay(trace, tiers)
        written = result.tier(specs[1].name).blocks_written
        options.append(AdmissionOption(rules, result.block_hit_ratio, written))
    return options


def pick_admission(options: Sequence[AdmissionOption], max_hit_loss: float
                   ) -> AdmissionOption | None:
    """Fewest lower-tier writes among rules losing at most ``max_hit_loss`` against admitting
    every block; ties go to the higher hit ratio."""
    if not options:
        return None
    base = next(o for o in options if not o.rules)
    fine = [o for o in options if base.block_hit_ratio - o.block_hit_ratio <= max_hit_loss]
    return min(fine, key=lambda o: (o.lower_blocks_written, -o.block_hit_ratio))


def _smallest(tier: str, ratio: Callable[[int], float], goal: float, most: int
              ) -> TierSize | None:
    """Geometric bisection over chunk counts in [1, most] for the first that reaches goal."""
    seen: dict[int, float] = {}

    def reaches(chunks: int) -> bool:
        if chunks not in seen:
            seen[chunks] = ratio(chunks)
        return seen[chunks] >= goal

    if not reaches(most):
        return None
    if reaches(1):
        return TierSize(tier, 1, seen[1])
    low, high = 1, most
    while high - low > 1 and high > low * PRECISION:
        mid = min(high - 1, max(low + 1, int(math.sqrt(low * high))))
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return TierSize(tier, high, seen[high])


def _replay(trace: Trace, specs: Sequence[TierSpec]) -> SimResult:
    return simulate(trace.requests, specs, trace.block_tokens)


def _unique_blocks(trace: Trace) -> int:
    return max(1, len({b for r in trace.requests for b in r.blocks}))
