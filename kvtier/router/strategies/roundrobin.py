"""``roundrobin``: each request to the next healthy backend."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.router.backends import Backend
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies.base import Decision, Strategy


class RoundRobin(Strategy):
    name = "roundrobin"

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        return Decision(self.next_in_turn(candidates), "turn")
