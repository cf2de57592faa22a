"""Prefix-hit accounting shared by the simulator, the Belady ceiling and the analyses.

A block is a hit only while the prefix is contiguous, as an engine sees it: the first block
missing from every tier ends the hit run for that request. Token hits count only full blocks;
a partial last block's tokens are prompt tokens that are always recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.trace.formats import Request


@dataclass
class HitCounts:
    """Running totals over the requests replayed so far."""

    requests: int = 0
    prompt_blocks: int = 0
    prompt_tokens: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0

    def add(self, request: Request, prefix: int) -> None:
        """Count one request whose first ``prefix`` blocks were hits."""
        self.requests += 1
        self.prompt_blocks += len(request.blocks)
        self.prompt_tokens += request.input_tokens
        self.hit_blocks += prefix
        self.hit_tokens += min(prefix, request.full_blocks) * request.block_tokens

    @property
    def block_hit_ratio(self) -> float:
        return self.hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def token_hit_ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.hit_tokens
