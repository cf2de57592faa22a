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

The lookups are waited for only until the answers in hand settle the choice: a candidate
whose node server has not answered could at best hold everything beyond its device history
with nothing to wait for (:func:`kvtier.router.cost.lower_bound`), and once the best rank
known is below every such bound, no answer still out can change the winner (the rest finish
unwaited; when the device history settles it, none is sent). On a fleet whose node servers
answer at different speeds on busy cores, a decision then waits for the quicker one whenever
that one's backend wins anyway.

Reasons (of the answers in hand: a candidate not waited for counts its device history
only): ``affinity`` (the winner is where the prompt would be soonest if no backend had a
queue: its cache won), ``load`` (another backend would be, but its queue made this one
sooner), ``cold`` (nobody holds any of it: least wait), ``no_keys`` (the prompt could not be
keyed: least wait).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.router.backends import Backend
from kvtier.router.cost import DEVICE, Holding, Prediction, estimate, lower_bound
from kvtier.router.keys import PromptKeys
from kvtier.router.lookup import NOTHING, Answer
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies.base import Decision, Strategy

log = logging.getLogger("kvtier.router")

Rank = tuple[float, int, int]


@dataclass(frozen=True)
class Scored:
    rank: Rank
    """Estimated TTFT plus crowding, then requests in flight, then the turn: never tied."""
    lowest: Rank
    """The lowest rank its node server's answer could give it (its rank once answered)."""
    backend: Backend
    prediction: Prediction
    crowd_s: float
    """The crowding counted in its rank (:meth:`CacheAware._crowd_s` at the decision's now)."""
    keys: PromptKeys | None
    waited: bool = True
    """False: its node server's answer was not waited for (the others settled the choice);
    its prediction counts only its device history."""


class CacheAware(Strategy):
    name = "cache"

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        keysets = [await request.keys(b.namespace_for(request.model)) for b in candidates]
        if all(k is None for k in keysets):
            return Decision(self._least_wait(candidates, self.ctx.clock()), "no_keys")
        known = next(k for k in keysets if k is not None)
        turn = next(self._turn)
        settled: list[list[Scored]] = []

        def enough(answers: Mapping[tuple[str, bytes], Answer]) -> bool:
            scored = self._score(candidates, keysets, known, answers, turn)
            if _settled(scored):
                settled.append(scored)
            return bool(settled)

        answers = await self._lookups(candidates, keysets, enough)
        # scored after the lookups (others' flights started meanwhile), or when the answers
        # in hand settled it: the winner is then the same whatever the rest would say
        scored = settled[-1] if settled else self._score(candidates, keysets, known, answers,
                                                         turn, final=True)
        best = min(scored, key=lambda s: s.rank)
        reason = self._reason(best.backend, scored)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cache: %s (%s) among %s", best.backend.name, reason,
                      "; ".join(self._explain(s) for s in scored))
        return Decision(best.backend, reason, best.prediction, best.keys, best.crowd_s)

    def _score(self, candidates: Sequence[Backend], keysets: Sequence[PromptKeys | None],
               known: PromptKeys, answers: Mapping[tuple[str, bytes], Answer], turn: int,
               final: bool = False) -> list[Scored]:
        """Every candidate's rank now with the answers in hand. One whose node server has
        not answered yet counts its device history only, and could get as low as everything
        beyond it held with nothing to wait for (:func:`lower_bound`); ``final``: no more
        answers are coming (a missing one holds nothing)."""
        now = self.ctx.clock()
        scored: list[Scored] = []
        for i, (backend, keys) in enumerate(zip(candidates, keysets, strict=True)):
            load = backend.load
            crowd = self._crowd_s(backend, now)
            tie = (load.in_flight, (i - turn) % len(candidates))
            ask = self._ask(backend, keys)
            waited = final or ask is None or ask in answers
            # a backend whose keys are unknown (no node server) can only recompute
            holding = Holding() if keys is None else Holding(
                self.ctx.history.held(backend.index, keys.keys),
                *(answers.get(ask, NOTHING) if ask is not None else NOTHING))
            wait = load.wait_s(now)
            pred = estimate(known.prompt_tokens, known.chunk_tokens, holding,
                            load.speed.value, wait)
            rank = (round(pred.ttft_s + crowd, 6), *tie)
            lowest = rank if waited else (round(lower_bound(
                known.prompt_tokens, known.chunk_tokens, load.speed.value, wait) + crowd, 6),
                *tie)
            scored.append(Scored(rank, lowest, backend, pred, crowd, keys, waited))
        return scored

    @staticmethod
    def _ask(backend: Backend, keys: PromptKeys | None) -> tuple[str, bytes] | None:
        if backend.node_url is None or keys is None:
            return None
        return backend.node_url, keys.namespace.fingerprint

    def _explain(self, s: Scored) -> str:
        b, p = s.backend, s.prediction
        return (f"{b.name} ttft {p.ttft_s:.4f} wait {p.wait_s:.4f} load {p.load_s:.4f} "
                f"held {p.held_tokens} crowd {s.crowd_s:.4f} others {b.load.others} "
                f"flights {b.load.in_flight} speed {b.load.speed.value:.0f}"
                f"{'' if s.waited else ' (lookup not waited for)'}")

    def _crowd_s(self, backend: Backend, now: float) -> float:
        """What the streams on ``backend`` cost a newcomer there beyond its prefill queue:
        ``decode_weight`` of the measured crowding (:meth:`BackendLoad.crowding_s`); at
        weight 0 the slope is not fitted on every decision."""
        weight = self.ctx.config.cost.decode_weight
        return weight * backend.load.crowding_s(now) if weight else 0.0

    @staticmethod
    def _reason(winner: Backend, scored: Sequence[Scored]) -> str:
        """``affinity`` if the winner is where the prompt would be soonest with every queue
        empty (ties: the one whose device cache has most of it), ``load`` if that is another
        backend, ``cold`` if nobody holds any of it."""
        if all(s.prediction.held_tokens == 0 for s in scored):
            return "cold"
        best = min(scored, key=lambda s: (round(s.prediction.ttft_s - s.prediction.wait_s, 6),
                                          -s.prediction.sources.get(DEVICE, 0), s.rank[2]))
        return "affinity" if best.backend is winner else "load"

    async def _lookups(self, candidates: Sequence[Backend], keysets: Sequence[PromptKeys | None],
                       enough: Callable[[Mapping[tuple[str, bytes], Answer]], bool]
                       ) -> dict[tuple[str, bytes], Answer]:
        lookups = self.ctx.lookups
        if lookups is None:
            return {}
        asks = {ask: k.keys for b, k in zip(candidates, keysets, strict=True)
                if k is not None and (ask := self._ask(b, k)) is not None}
        return await lookups.many(asks, enough)

    def _least_wait(self, candidates: Sequence[Backend], now: float) -> Backend:
        turn = next(self._turn)
        return min(enumerate(candidates), key=lambda ib: (
            round(ib[1].load.wait_s(now), 6), ib[1].load.in_flight,
            (ib[0] - turn) % len(candidates)))[1]


def _settled(scored: Sequence[Scored]) -> bool:
    """The lowest rank is below what any other candidate could get, whatever the answers
    still out say (an answer only lowers a rank: it can only add held chunks), and the
    winner's own prediction is final (answered, or at its bound already: its device cache
    holds the prompt), so that what /metrics compares with the actual hit is what it would
    be with every answer."""
    best = min(scored, key=lambda s: s.rank)
    return ((best.waited or best.rank == best.lowest)
            and all(best.rank < s.lowest for s in scored if s is not best))
