"""``prefix``: consistent hashing on the prompt's leading chunk keys.

The key of chunk ``--prefix-chunks`` (default 2: the first 512 tokens with 256-token
chunks) names the whole prefix up to it, so prompts sharing it go to the same backend and
find it in vLLM's cache or the node's arena. Keys come from the backend's node server
namespace (the same on every backend of one model). A prompt shorter than that, or one the
router cannot key, goes round robin.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.router.backends import Backend
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies.base import Decision, RoutingContext, Strategy
from kvtier.router.strategies.session import PoolRing, ring_pick


class PrefixAffinity(Strategy):
    name = "prefix"

    def __init__(self, ctx: RoutingContext) -> None:
        super().__init__(ctx)
        self.ring = PoolRing(ctx.pool)

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        ns = next((ns for b in candidates if (ns := b.namespace_for(request.model))), None)
        keys = await request.keys(ns)
        if keys is None:
            return Decision(self.next_in_turn(candidates), "no_keys")
        n = self.ctx.config.prefix_chunks
        if len(keys.keys) < n:
            return Decision(self.next_in_turn(candidates), "short")
        decision = ring_pick(self.ring.now(), keys.keys[n - 1], candidates)
        if decision is None:
            return Decision(self.next_in_turn(candidates), "rehash", keys=keys)
        return Decision(decision.backend, decision.reason, keys=keys)
