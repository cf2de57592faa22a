"""The ``cache`` strategy waits for node-server lookups only until their answers settle the
choice: the winner is then the one it would be with every answer in hand, whatever those
still out say — and when the router's device history settles it, no lookup is sent."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from kvtier.keys import ChunkKey
from kvtier.router.backends import BackendPool
from kvtier.router.config import RouterConfig
from kvtier.router.history import DeviceHistory
from kvtier.router.keys import NamespaceInfo, Renderers
from kvtier.router.lookup import NOTHING, Answer, NodeLookups
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies import RoutingContext
from kvtier.router.strategies.cache import CacheAware

CHUNK = 16
NS = NamespaceInfo(b"\x07" * 32, CHUNK, "/nonexistent", "m")


class ScriptedLookups(NodeLookups):
    """Node servers that answer what the test says, after the delay it says."""

    def __init__(self, answers: dict[str, tuple[float, Answer]], patient: bool = False
                 ) -> None:
        self.spared_count = Counter("spared", "", registry=CollectorRegistry())
        super().__init__(cast(aiohttp.ClientSession, None), 1.0, spared=self.spared_count)
        self.answers = answers
        self.patient = patient
        """Waits for every answer (what the strategy did before it could settle early)."""
        self.asked: list[str] = []

    async def many(self, asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]],
                   enough: Callable[[Mapping[tuple[str, bytes], Answer]], bool] | None = None
                   ) -> dict[tuple[str, bytes], Answer]:
        return await super().many(asks, None if self.patient else enough)

    async def one(self, url: str, keys: Sequence[ChunkKey]) -> Answer:
        self.asked.append(url)
        delay, answer = self.answers.get(url, (0.0, NOTHING))
        await asyncio.sleep(delay)
        n = min(len(keys), len(answer[0]))
        return answer[0][:n], answer[1][:n]


def setup(answers: dict[str, tuple[float, Answer]], flights: Sequence[int] = (0, 0),
          patient: bool = False) -> tuple[CacheAware, BackendPool, ScriptedLookups]:
    config = RouterConfig(("http://a:1", "http://b:1"), ("http://node-a", "http://node-b"),
                          strategy="cache")
    pool = BackendPool(config)
    for backend, n in zip(pool, flights, strict=True):
        backend.healthy = True
        backend.namespaces = [NS]
        for _ in range(n):  # requests in flight with no prefill left: a tie on time
            backend.load.start(0.0, now=time.monotonic())
    lookups = ScriptedLookups(answers, patient)
    return CacheAware(RoutingContext(config, pool, lookups, DeviceHistory(60.0))), pool, lookups


def request(tokens: int = 10 * CHUNK + 3) -> RoutedRequest:
    body = {"model": "m", "prompt": list(range(1, tokens + 1))}
    return RoutedRequest.parse("/v1/completions", json.dumps(body).encode(), None, Renderers())


def _constant(wait: float) -> Callable[[float], float]:
    return lambda now: wait


def arena(chunks: int) -> Answer:
    return ("arena",) * chunks, (0.0,) * chunks


def test_a_slow_node_server_is_not_waited_for_once_the_others_settle_it() -> None:
    """``a`` holds the whole prompt in its arena and is the less busy: nothing ``b``'s node
    server could say would make ``b`` sooner, so its answer is not waited for."""
    async def main() -> None:
        strategy, pool, lookups = setup({"http://node-a": (0.0, arena(10)),
                                         "http://node-b": (2.0, arena(10))}, flights=(0, 1))
        start = time.monotonic()
        decision = await strategy.choose(request(), list(pool))
        assert time.monotonic() - start < 1.0, "b's slow lookup was waited for"
        assert decision.backend is pool.backends[0] and decision.reason == "affinity"
        assert decision.prediction is not None and decision.prediction.held_tokens == 10 * CHUNK
        assert lookups.spared_count._value.get() == 1
    asyncio.run(main())


def test_a_lookup_that_could_still_win_is_waited_for() -> None:
    """``b`` is less busy: its node server may hold the prompt too, so its answer is needed
    (and, holding it, ``b`` wins)."""
    async def main() -> None:
        strategy, pool, lookups = setup({"http://node-a": (0.0, arena(10)),
                                         "http://node-b": (0.3, arena(10))}, flights=(1, 0))
        start = time.monotonic()
        decision = await strategy.choose(request(), list(pool))
        assert time.monotonic() - start >= 0.3
        assert decision.backend is pool.backends[1]
        assert lookups.spared_count._value.get() == 0
    asyncio.run(main())


def test_a_prompt_the_device_history_settles_sends_no_lookup() -> None:
    async def main() -> None:
        strategy, pool, lookups = setup({}, flights=(0, 0))
        req = request()
        keys = await req.keys(NS)
        assert keys is not None
        strategy.ctx.history.record(0, keys.keys, 1000)
        decision = await strategy.choose(req, list(pool))
        assert decision.backend is pool.backends[0]
        assert decision.prediction is not None
        assert decision.prediction.sources.get("device") == 10 * CHUNK
        assert lookups.asked == [] and lookups.spared_count._value.get() == 2
    asyncio.run(main())


def test_settling_early_chooses_what_waiting_for_every_answer_chooses() -> None:
    """Random holdings, arrivals, device histories, queues and answer delays (zero, equal
    and reordered included): the backend chosen is the one chosen with every answer in
    hand, with the same prediction (what /metrics compares with the actual hit), and
    whatever is spared was not needed."""
    rng = random.Random(17)

    def answer() -> Answer:
        n = rng.choice([0, 0, 3, 10, 10])
        tiers = tuple(rng.choice(["arena", "fs", "s3"]) for _ in range(n))
        return tiers, tuple(rng.choice([0.0, 0.0, 0.001, 0.02, 0.5]) for _ in range(n))

    async def one_case() -> None:
        answers = {url: (rng.choice([0.0, 0.0, 0.002, 0.01]), answer())
                   for url in ("http://node-a", "http://node-b")}
        flights = (rng.choice([0, 0, 1, 3]), rng.choice([0, 0, 1, 3]))
        held = (rng.choice([0, 0, 4, 10]), rng.choice([0, 0, 4, 10]))
        tokens = rng.choice([5, CHUNK, 10 * CHUNK, 10 * CHUNK + 3])
        picks = []
        for patient in (False, True):
            strategy, pool, lookups = setup(answers, flights, patient)
            for backend in pool:  # queues that differ, the same in both runs
                backend.load.wait_s = _constant(0.01 * backend.load.in_flight)  # type: ignore[method-assign,assignment]
            req = request(tokens)
            keys = await req.keys(NS)
            assert keys is not None
            for i, n in enumerate(held):
                strategy.ctx.history.record(i, keys.keys[:n], 1000)
            decision = await strategy.choose(req, list(pool))
            assert decision.prediction is not None
            picks.append((decision.backend.index, decision.prediction.sources))
            spared.append(lookups.spared_count._value.get() if not patient else 0)
        assert picks[0] == picks[1], (answers, flights, held, tokens)

    spared: list[float] = []

    async def main() -> None:
        for _ in range(300):
            await one_case()
    asyncio.run(main())
    assert sum(1 for n in spared if n) > 30, "settling early was exercised"
    assert sum(1 for n in spared if n == 2) > 5, "and sending nothing"
