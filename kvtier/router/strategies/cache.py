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

Deciding costs time on the request's path (keying, lookups: milliseconds on busy cores) and
gains only where the candidates differ in what they hold. :class:`Worth` keeps, over the last
:data:`WINDOW` full decisions, what each gained (the winner's score against that of the
backend with the least queue and crowding, which needs no keys) and what it took. While the
mean gain is below the mean cost, as where every instance loads every prompt from a fast
shared tier at about its arena's speed, requests go to the least queue and crowding
(``shortcut``), their keys computed after they are sent so that the device history stays
whole, and one in :data:`SAMPLE_EVERY` is still decided in full to keep measuring; one
decision that would have saved a recompute brings full decisions back. ``--always-decide``
turns the shortcut off.

Reasons: ``affinity`` (the winner is where the prompt would be soonest if no backend had a
queue: its cache won), ``load`` (another backend would be, but its queue made this one
sooner), ``cold`` (nobody holds any of it: least wait), ``no_keys`` (the prompt could not be
keyed: least wait), ``shortcut`` (not decided in full: least queue and crowding).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.router.backends import Backend
from kvtier.router.cost import DEVICE, Holding, Prediction, estimate, lower_bound
from kvtier.router.keys import PromptKeys
from kvtier.router.lookup import NOTHING, Answer
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies.base import Decision, RoutingContext, Strategy

log = logging.getLogger("kvtier.router")

Rank = tuple[float, int, int]
WINDOW = 64
"""Full decisions the shortcut's gain and cost are averaged over."""
MIN_DECISIONS = 32
"""Full decisions measured before the shortcut may be taken."""
SAMPLE_EVERY = 8
"""While in shortcut, one request in this many is still decided in full."""


@dataclass(frozen=True)
class Scored:
    rank: Rank
    """Estimated TTFT plus crowding, then requests in flight, then the turn: never tied."""
    lowest: Rank
    """The lowest rank its node server's answer could give it (its rank once answered)."""
    backend: Backend
    prediction: Prediction
    keys: PromptKeys | None
    waited: bool = True
    """False: its node server's answer was not waited for (the others settled the choice);
    its prediction counts only its device history."""


class Worth:
    """Whether full decisions pay: over the last :data:`WINDOW` of them, the mean time to
    first token a decision saved against the shortcut's choice (the least queue and
    crowding, no keys), against the median time one took. The mean, because a rare decision
    that saves a recompute is what deciding is for; the median, because a one-off (the
    first request waiting for its tokenizer to load) must not stand for what deciding
    costs."""

    def __init__(self) -> None:
        self.gains: deque[float] = deque(maxlen=WINDOW)
        self.costs: deque[float] = deque(maxlen=WINDOW)
        self.shortcut = False
        self._since = 0

    @property
    def gain_s(self) -> float:
        return statistics.fmean(self.gains) if self.gains else 0.0

    @property
    def cost_s(self) -> float:
        return statistics.median(self.costs) if self.costs else 0.0

    def add(self, gain_s: float, cost_s: float) -> bool | None:
        """Counts a full decision; the new state when it changes (else None)."""
        self.gains.append(gain_s)
        self.costs.append(cost_s)
        was = self.shortcut
        self.shortcut = len(self.gains) >= MIN_DECISIONS and self.gain_s < self.cost_s
        return self.shortcut if self.shortcut != was else None

    def take_shortcut(self) -> bool:
        """True for all but one request in :data:`SAMPLE_EVERY` while in shortcut, so that
        full decisions keep measuring what they would gain."""
        if not self.shortcut:
            return False
        self._since = (self._since + 1) % SAMPLE_EVERY
        return self._since != 0


class CacheAware(Strategy):
    name = "cache"

    def __init__(self, ctx: RoutingContext) -> None:
        super().__init__(ctx)
        self.worth = Worth()
        self._background: set[asyncio.Task[None]] = set()

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        if self.ctx.config.cost.shortcut and self.worth.take_shortcut():
            backend = self._least_crowded(candidates, self.ctx.clock())
            self._remember_later(request, backend)
            return Decision(backend, "shortcut")
        start = time.perf_counter()
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
        shortcut = min(scored, key=lambda s: (
            round(s.prediction.wait_s + self._crowd_s(s.backend), 6), *s.rank[1:]))
        self._weigh(shortcut.rank[0] - best.rank[0], time.perf_counter() - start)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("cache: %s (%s) among %s", best.backend.name, reason,
                      "; ".join(self._explain(s) for s in scored))
        return Decision(best.backend, reason, best.prediction, best.keys)

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
            crowd = self._crowd_s(backend)
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
            scored.append(Scored(rank, lowest, backend, pred, keys, waited))
        return scored

    def _weigh(self, gain_s: float, cost_s: float) -> None:
        changed = self.worth.add(gain_s, cost_s)
        if changed is None or not self.ctx.config.cost.shortcut:
            return
        gain, cost = 1000 * self.worth.gain_s, 1000 * self.worth.cost_s
        if changed:
            log.info("cache: a full decision gains %.1f ms of time to first token (mean) and "
                     "takes %.1f ms (median; of the last %d): routing by queue and crowding, "
                     "deciding one request in %d", gain, cost, len(self.worth.gains),
                     SAMPLE_EVERY)
        else:
            log.info("cache: a full decision gains %.1f ms (mean) and takes %.1f ms "
                     "(median): deciding every request again", gain, cost)

    def _least_crowded(self, candidates: Sequence[Backend], now: float) -> Backend:
        """The shortcut: the least queue and crowding, no keys (ties: fewer in flight, then
        round robin)."""
        turn = next(self._turn)
        return min(enumerate(candidates), key=lambda ib: (
            round(ib[1].load.wait_s(now) + self._crowd_s(ib[1]), 6), ib[1].load.in_flight,
            (ib[0] - turn) % len(candidates)))[1]

    def _remember_later(self, request: RoutedRequest, backend: Backend) -> None:
        """The prompt's keys go into the device history as a decision's would, computed
        off the request's path (after it is sent on), so that the full decisions sampled
        later still know what each device cache holds."""
        async def remember() -> None:
            keys = await request.keys(backend.namespace_for(request.model))
            if keys is not None:
                self.ctx.remember(backend, keys, request.model)

        task = asyncio.get_running_loop().create_task(remember())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    def _ask(backend: Backend, keys: PromptKeys | None) -> tuple[str, bytes] | None:
        if backend.node_url is None or keys is None:
            return None
        return backend.node_url, keys.namespace.fingerprint

    def _explain(self, s: Scored) -> str:
        b, p = s.backend, s.prediction
        return (f"{b.name} ttft {p.ttft_s:.4f} wait {p.wait_s:.4f} load {p.load_s:.4f} "
                f"held {p.held_tokens} crowd {self._crowd_s(b):.4f} others {b.load.others} "
                f"flights {b.load.in_flight} speed {b.load.speed.value:.0f}"
                f"{'' if s.waited else ' (lookup not waited for)'}")

    def _crowd_s(self, backend: Backend) -> float:
        """What the streams on ``backend`` cost a newcomer there beyond its prefill queue:
        ``decode_weight`` of the measured crowding (:meth:`BackendLoad.crowding_s`); at
        weight 0 the slope is not fitted on every decision."""
        weight = self.ctx.config.cost.decode_weight
        return weight * backend.load.crowding_s() if weight else 0.0

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
