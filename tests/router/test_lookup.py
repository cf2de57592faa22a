"""Node-server lookups from the router: a node server that hangs, over real HTTP, stops
costing every decision the lookup timeout after a few tries, and is asked again (one probe
at a time) until it answers."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest
from aiohttp import web

from kvtier.keys import ChunkKey
from kvtier.router import lookup
from kvtier.router.lookup import NOTHING, NodeLookups

KEYS = [ChunkKey(bytes([i]) * 32) for i in range(2)]


class NodeStub:
    """``POST /v1/lookup``: holds every key in its arena, or hangs when told to."""

    def __init__(self) -> None:
        self.hang = False
        self.answer: bytes | None = None
        """Sent instead of an answer, when set."""
        self.asked = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> NodeStub:
        app = web.Application()
        app.router.add_post("/v1/lookup", self._lookup)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _lookup(self, request: web.Request) -> web.Response:
        self.asked += 1
        keys = (await request.json())["keys"]
        if self.hang:
            await asyncio.sleep(30)
        if self.answer is not None:
            return web.Response(body=self.answer, content_type="application/json")
        return web.json_response({"tiers": ["arena"] * len(keys),
                                  "arrival_s": [0.0] * len(keys)})


def test_a_hung_node_server_is_not_asked_until_its_backoff_ends(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(lookup, "FIRST_BACKOFF_S", 0.5)

    async def timed(lookups: NodeLookups, url: str) -> tuple[float, object]:
        start = time.monotonic()
        answer = await lookups.one(url, KEYS)
        return time.monotonic() - start, answer

    async def main() -> None:
        node = await NodeStub().start()
        async with aiohttp.ClientSession() as session:
            lookups = NodeLookups(session, 0.5)  # the first opens the connection
            took, answer = await timed(lookups, node.url)
            assert answer == (("arena", "arena"), (0.0, 0.0)) and took < 0.5
            node.hang = True
            for _ in range(lookup.FAILURES_TO_OPEN):
                took, answer = await timed(lookups, node.url)
                assert answer == NOTHING and took >= 0.5
            asked = node.asked
            many = await asyncio.gather(*(timed(lookups, node.url) for _ in range(20)))
            assert all(a == NOTHING and t < 0.25 for t, a in many), "not asked: no wait"
            assert node.asked == asked

            await asyncio.sleep(0.55)  # the backoff ended: one probe, which hangs too
            probes = await asyncio.gather(*(timed(lookups, node.url) for _ in range(10)))
            assert node.asked == asked + 1, "one probe at a time"
            waits = sorted(t for t, _ in probes)
            assert waits[-1] >= 0.5 and waits[-2] < 0.25, "the others are not kept waiting"
            assert lookups._breakers[node.url].backoff_s == 1.0, "a failed probe doubles it"

            node.hang = False
            await asyncio.sleep(1.05)
            took, answer = await timed(lookups, node.url)
            assert answer == (("arena", "arena"), (0.0, 0.0))
            took, answer = await timed(lookups, node.url)
            assert answer != NOTHING and took < 0.5, "asked again as before"
        await node.stop()

    with caplog.at_level(logging.INFO, "kvtier.router"):
        asyncio.run(main())
    stopped = [r for r in caplog.records if "lookups in a row" in r.getMessage()]
    again = [r for r in caplog.records if "answers lookups again" in r.getMessage()]
    assert len(stopped) == 1 and len(again) == 1, "logged once per change, not per lookup"


def test_nonsense_from_a_node_server_is_nothing_held_and_never_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nested too deep to parse, far larger than its keys need, the wrong shape: each lookup
    answers nothing held (never raises into a request), the breaker opens, and its probe is
    not left stuck: once the server answers again, it is asked again."""
    monkeypatch.setattr(lookup, "FIRST_BACKOFF_S", 0.2)
    nonsense = [b"[" * 100_000 + b"]" * 100_000,  # RecursionError in the parser
                b'{"tiers": ["arena"], "arrival_s": [0.0], "pad": "' + b"x" * (1 << 20) + b'"}',
                b'{"tiers": 5}', b"\xff\xfe not json"]

    async def main() -> None:
        node = await NodeStub().start()
        async with aiohttp.ClientSession() as session:
            lookups = NodeLookups(session, 2.0)
            for body in nonsense * 2:
                node.answer = body
                start = time.monotonic()
                assert await lookups.one(node.url, KEYS) == NOTHING
                assert time.monotonic() - start < 1.0
            breaker = lookups._breakers[node.url]
            assert breaker.open
            await asyncio.sleep(0.25)
            assert await lookups.one(node.url, KEYS) == NOTHING  # the probe: nonsense again
            assert not breaker.probing and breaker.backoff_s == 0.4
            node.answer = None
            await asyncio.sleep(0.45)
            assert await lookups.one(node.url, KEYS) == (("arena", "arena"), (0.0, 0.0))
            assert not breaker.open
        await node.stop()
    asyncio.run(main())
