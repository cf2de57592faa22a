"""The strategy contract."""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.router.backends import Backend, BackendPool
from kvtier.router.config import RouterConfig
from kvtier.router.cost import Prediction
from kvtier.router.history import DeviceHistory
from kvtier.router.keys import PromptKeys
from kvtier.router.lookup import NodeLookups
from kvtier.router.request import RoutedRequest


@dataclass(frozen=True)
class Decision:
    backend: Backend
    reason: str
    prediction: Prediction | None = None
    keys: PromptKeys | None = None
    """The prompt's keys on that backend, when the strategy computed them (the router then
    records the prefix in its device history)."""
    crowd_s: float = 0.0
    """What the streams there were counted to cost, beyond the prediction's TTFT (``cache``)."""


@dataclass
class RoutingContext:
    """What strategies may read: the configuration, the pool, lookups and history."""

    config: RouterConfig
    pool: BackendPool
    lookups: NodeLookups | None
    history: DeviceHistory
    clock: Callable[[], float] = field(default=time.monotonic)


class Strategy(ABC):
    """Chooses a backend. ``choose`` gets a non-empty list of healthy candidates (the
    backends already tried for this request left out) and must return one of them; it may
    be called again for the same request after a failed attempt."""

    name: str = ""

    def __init__(self, ctx: RoutingContext) -> None:
        self.ctx = ctx
        self._turn = itertools.count()

    @abstractmethod
    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        ...

    def next_in_turn(self, candidates: Sequence[Backend]) -> Backend:
        """Round robin over whatever the candidates are now."""
        return candidates[next(self._turn) % len(candidates)]
