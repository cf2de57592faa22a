"""``cache``: the backend with the lowest estimated time to first token.

For each candidate: the prompt's keys in its namespace, what its device cache should hold
(the router's history), what its node server holds and when it could be in the arena (one
lookup per node server, all in parallel, bounded by ``lookup_timeout_s``), its queue and its
measured prefill speed; :func:`kvtier.router.cost.estimate` turns them into a TTFT. To that
``decode_weight`` adds the candidate's measured crowding (what the streams decoding there
would cost the newcomer, and it them: :meth:`kvtier.router.load.BackendLoad.crowding_s`): the
higher it is, the more the least crowded backend wins over the one holding the prompt
(default 1: as measured; 0 counts only the prefill queue, and a fast shared tier's few
milliseconds of load then pile conversations onto one instance: docs/router.md). The minimum
wins; ties go to the backend with fewer requests in flight, then round robin.

Reasons: ``affinity`` (the winner is where the prompt would be soonest if no backend had a
queue: its cache won), ``load`` (another backend would be, but its queue made this one
sooner), ``cold`` (nobody holds any of it: least wait), ``no_keys`` (the prompt could not be
keyed: least wait).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.router.backends import Backend
from kvtier.router.cost import DEVICE, Holding, Prediction, estimate
from kvtier.router.keys import PromptKeys
from kvtier.router.lookup import NOTHING, Answer
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies.base import Decision, Strategy

log = logging.getLogger("kvtier.router")


class CacheAware(Strategy):
    name = "cache"

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        keysets = [await request.keys(b.namespace_for(request.model)) for b in candidates]
        if all(k is None for k in keysets):
            return Decision(self._least_wait(candidates, self.ctx.clock()), "no_keys")
        answers = await self._lookups(candidates, keysets)
        now = self.ctx.clock()  # after the lookups: others' flights started meanwhile
        known = next(k for k in keysets if k is not None)
        scored: list[tuple[tuple[float, int, int], Backend, Prediction, PromptKeys | None]] = []
        turn = next(self._turn)
        for i, (backend, keys) in enumerate(zip(candidates, keysets, strict=True)):
            # a backend whose keys are unknown (no node server) can only recompute
            holding = Holding() if keys is None else self._holding(backend, keys, answers)
            pred = estimate(known.prompt_tokens, known.chunk_tokens, holding,
                            backend.load.speed.value, backend.load.wait_s(now))
            rank = (round(pred.ttft_s + self._crowd_s(backend), 6), backend.load.in_flight,
                    (i - turn) % len(candidates))
            scored.append((rank, backend, pred, keys))
        _, backend, pred, keys = min(scored, key=lambda s: s[0])
        reason = self._reason(backend, scored)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cache: %s (%s) among %s", backend.name, reason, "; ".join(
                f"{b.name} ttft {p.ttft_s:.4f} wait {p.wait_s:.4f} load {p.load_s:.4f} "
                f"held {p.held_tokens} crowd {self._crowd_s(b):.4f} others {b.load.others} "
                f"flights {b.load.in_flight} "
                f"speed {b.load.speed.value:.0f}" for _, b, p, _ in scored))
        return Decision(backend, reason, pred, keys)

    def _crowd_s(self, backend: Backend) -> float:
        """What the streams on ``backend`` cost a newcomer there beyond its prefill queue:
        ``decode_weight`` of the measured crowding (:meth:`BackendLoad.crowding_s`); at
        weight 0 the slope is not fitted on every decision."""
        weight = self.ctx.config.cost.decode_weight
        return weight * backend.load.crowding_s() if weight else 0.0

    @staticmethod
    def _reason(winner: Backend, scored: Sequence[tuple[tuple[float, int, int], Backend,
                                                       Prediction, PromptKeys | None]]) -> str:
        """``affinity`` if the winner is where the prompt would be soonest with every queue
        empty (ties: the one whose device cache has most of it), ``load`` if that is another
        backend, ``cold`` if nobody holds any of it."""
        if all(p.held_tokens == 0 for _, _, p, _ in scored):
            return "cold"
        best = min(scored, key=lambda s: (round(s[2].ttft_s - s[2].wait_s, 6),
                                          -s[2].sources.get(DEVICE, 0), s[0][2]))
        return "affinity" if best[1] is winner else "load"

    def _holding(self, backend: Backend, keys: PromptKeys,
                 answers: dict[tuple[str, bytes], Answer]) -> Holding:
        device = self.ctx.history.held(backend.index, keys.keys)
        tiers, arrival = (answers.get((backend.node_url, keys.namespace.fingerprint), NOTHING)
                          if backend.node_url else NOTHING)
        return Holding(device, tiers, arrival)

    async def _lookups(self, candidates: Sequence[Backend],
                       keysets: Sequence[PromptKeys | None]) -> dict[tuple[str, bytes], Answer]:
        lookups = self.ctx.lookups
        if lookups is None:
            return {}
        asks = {(b.node_url, k.namespace.fingerprint): k.keys
                for b, k in zip(candidates, keysets, strict=True)
                if b.node_url is not None and k is not None}
        return await lookups.many(asks)

    def _least_wait(self, candidates: Sequence[Backend], now: float) -> Backend:
        turn = next(self._turn)
        return min(enumerate(candidates), key=lambda ib: (
            round(ib[1].load.wait_s(now), 6), ib[1].load.in_flight,
            (ib[0] - turn) % len(candidates)))[1]
