"""What a replay reports: per tier, and over all tiers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.trace.hits import HitCounts

WritePolicy = Literal["through", "back"]
"""When a tier's write reaches the tier below: on every write, or when the chunk is evicted."""


@dataclass(frozen=True)
class TierResult:
    name: str
    capacity_chunks: int | None
    eviction: str
    admission: tuple[tuple[str, int], ...]
    write: WritePolicy
    hits: int
    hit_ratio: float
    blocks_written: int
    blocks_read: int
    bytes_written: int | None
    bytes_read: int | None
    evictions: int
    unreachable: int = 0
    """Chunks held at the end whose chain parent no tier holds: space a hole wasted."""


@dataclass(frozen=True)
class SimResult:
    counts: HitCounts
    tiers: tuple[TierResult, ...]
    block_tokens: int
    block_bytes: int | None
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def block_hit_ratio(self) -> float:
        return self.counts.block_hit_ratio

    @property
    def token_hit_ratio(self) -> float:
        return self.counts.token_hit_ratio

    @property
    def accesses_per_s(self) -> float:
        return self.counts.prompt_blocks / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def tier(self, name: str) -> TierResult:
        return next(t for t in self.tiers if t.name == name)
