"""Admission rules for lower tiers ("choose admission before capacity").

Each rule is registered by name and built with one integer parameter; a tier admits a chunk
only when every configured rule admits it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import AdmissionContext, AdmissionPolicy


class Always(AdmissionPolicy):
    def admit(self, ctx: AdmissionContext) -> bool:
        return True


class MinPriority(AdmissionPolicy):
    """Admit chunks whose retention priority is at least ``param``."""

    def admit(self, ctx: AdmissionContext) -> bool:
        return ctx.priority >= self.param


class MinPrefixTokens(AdmissionPolicy):
    """Admit chunks that complete a prefix of at least ``param`` tokens."""

    def admit(self, ctx: AdmissionContext) -> bool:
        return ctx.prefix_tokens >= self.param


class AfterUses(AdmissionPolicy):
    """Admit a chunk once it has been used ``param`` times (stored or hit above).

    Counts live in a bounded recency-ordered table (a ghost list of key digests), so keys
    that were seen once long ago are forgotten instead of growing memory without bound.
    """

    def __init__(self, param: int, max_tracked: int = 1 << 20) -> None:
        super().__init__(param)
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        self._max = max_tracked

    def record(self, key: bytes) -> None:
        tag = key[:8]
        self._counts[tag] = self._counts.pop(tag, 0) + 1
        if len(self._counts) > self._max:
            self._counts.popitem(last=False)

    def uses(self, key: bytes) -> int:
        return self._counts.get(key[:8], 0)

    def admit(self, ctx: AdmissionContext) -> bool:
        return self.uses(ctx.key) >= self.param
