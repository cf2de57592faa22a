"""Routing strategies, registered by name (one small file each).

A strategy picks one backend among the healthy candidates for a request and says why
(``Decision.reason``, counted in ``kvtier_router_decisions_total{strategy, reason}``). It
never sends anything to a backend: the router does, and retries elsewhere what failed
before a byte reached the client.
"""

from __future__ import annotations

from kvtier.registry import Registry
from kvtier.router.strategies.base import Decision, RoutingContext, Strategy

STRATEGIES: Registry[Strategy] = Registry("routing strategy")
STRATEGIES.register("roundrobin", "kvtier.router.strategies.roundrobin:RoundRobin")
STRATEGIES.register("session", "kvtier.router.strategies.session:SessionAffinity")
STRATEGIES.register("prefix", "kvtier.router.strategies.prefix:PrefixAffinity")
STRATEGIES.register("cache", "kvtier.router.strategies.cache:CacheAware")

__all__ = ["STRATEGIES", "Decision", "RoutingContext", "Strategy"]
