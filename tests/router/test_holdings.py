"""The router's memory of what its node servers hold (:mod:`kvtier.router.holdings`): what a
lookup would answer, recalled without sending it — and asked again whenever the memory cannot
say, has expired, or was contradicted."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from stubs import (
    completion,
    held_by,
    node,
    post,
    router_config,
    running_router,
    stubs,
    with_engines,
)

from kvtier.keys import ChunkKey
from kvtier.router import holdings
from kvtier.router.config import CostModel
from kvtier.router.holdings import (
    ARENA,
    MAX_NAME,
    MAX_SHARED,
    PACE_S,
    STALE_PACE_S,
    Holdings,
    shared_tiers,
)
from kvtier.router.lookup import NodeLookups

A, B = "http://node-a", "http://node-b"


def keys(start: int, n: int) -> list[ChunkKey]:
    return [ChunkKey(i.to_bytes(32, "big")) for i in range(start, start + n)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_answer_is_recalled_until_it_expires_and_its_end_is_remembered() -> None:
    """Three chunks held in two tiers, then one not held: recalled as answered (the `fs`
    arrivals from the answer's own pace), the chunks after the first one not held cannot be
    held either; after ``ttl_s`` nothing is recalled."""
    clock = Clock()
    h = Holdings(10.0, clock=clock)
    prompt = keys(0, 6)
    h.learn(A, prompt, (("arena", "fs", "fs"), (0.0, 0.004, 0.008)), ["fs"])
    assert h.recall(A, prompt) == (("arena", "fs", "fs"), (0.0, 0.004, 0.008))
    assert h.recall(A, prompt[:2]) == (("arena", "fs"), (0.0, 0.004))
    assert h.recall(B, prompt) is None, "a node server never heard from is asked"
    clock.now += 10.5
    assert h.recall(A, prompt) is None


def test_a_prompt_sent_is_in_its_arena_and_in_a_tier_the_others_share() -> None:
    """After a prompt goes to A: A holds it all in its arena; B, which names the same shared
    tier, holds it there (at B's pace for that tier); C shares nothing with A and is asked."""
    h = Holdings(30.0)
    system = keys(0, 2)
    h.learn(A, system, (("arena", "arena"), (0.0, 0.0)), ["fs"])
    h.learn(B, system, (("fs", "fs"), (0.002, 0.004)), ["fs", "s3"])
    h.learn("http://node-c", system, (("arena", "arena"), (0.0, 0.0)), [])
    prompt = system + keys(10, 3)
    h.sent(A, prompt)
    assert h.recall(A, prompt) == ((ARENA,) * 5, (0.0,) * 5)
    tiers, arrivals = h.recall(B, prompt) or ((), ())
    assert tiers == ("fs",) * 5
    assert arrivals == pytest.approx((0.002, 0.004, 0.006, 0.008, 0.01))
    assert h.recall("http://node-c", prompt) is None, "told about, not held there: asked"


def test_a_lower_tier_whose_pace_was_not_answered_lately_is_asked() -> None:
    """B's chunks in the shared tier stay remembered while prompts keep going to A, but how
    fast B reads them there is its queue's: once B's last answer with chunks there is older
    than ``PACE_S``, B is asked; an answer about any other prompt renews it."""
    clock = Clock()
    h = Holdings(30.0, clock=clock)
    system = keys(0, 2)
    h.learn(A, system, (("arena", "arena"), (0.0, 0.0)), ["fs"])
    h.learn(B, system, ((), ()), ["fs"])
    h.sent(A, system)
    assert h.recall(B, system) is None, "B never said how fast its fs reads"
    h.learn(B, system, (("fs", "fs"), (0.005, 0.01)), ["fs"])
    assert h.recall(B, system) == (("fs", "fs"), (0.005, 0.01))
    for _ in range(3):
        clock.now += PACE_S / 2
        h.sent(A, system)
    assert h.recall(A, system) == (("arena", "arena"), (0.0, 0.0))
    assert h.recall(B, system) is None
    h.learn(B, keys(7, 1), (("fs",), (0.002,)), ["fs"])
    assert h.recall(B, system) == (("fs", "fs"), (0.002, 0.004)), "its chunks were kept"


def test_an_old_pace_answers_a_decision_and_is_due_until_too_old() -> None:
    """A pace older than ``PACE_S`` still answers a decision (``recall_all``) and marks its
    node server due to be asked again in the background; past ``STALE_PACE_S`` it answers
    nothing. An arena-only answer has no pace and is never due; ``recall`` (fresh only) is
    None as soon as the pace is older than ``PACE_S``."""
    clock = Clock()
    h = Holdings(60.0, clock=clock)
    prompt = keys(0, 3)
    h.learn(A, prompt, (("arena",) * 3, (0.0,) * 3), ["fs"])
    h.learn(B, prompt, (("fs",) * 3, (0.004, 0.008, 0.012)), ["fs"])
    asks = {(A, b"ns"): prompt, (B, b"ns"): prompt}
    fresh = h.recall_all(asks)
    assert fresh.answers[(B, b"ns")] == (("fs",) * 3, (0.004, 0.008, 0.012))
    assert fresh.due == frozenset()
    clock.now += PACE_S + 0.01
    old = h.recall_all(asks)
    assert old.answers == fresh.answers, "the last pace, not a guess"
    assert old.due == {(B, b"ns")}, "A holds it in its arena: nothing to renew"
    assert h.recall(B, prompt) is None
    clock.now += STALE_PACE_S
    late = h.recall_all(asks)
    assert set(late.answers) == {(A, b"ns")} and late.due == frozenset()
    h.learn(B, keys(9, 1), (("fs",), (0.003,)), ["fs"])
    renewed = h.recall_all(asks)
    tiers, arrivals = renewed.answers[(B, b"ns")]
    assert tiers == ("fs",) * 3 and arrivals == pytest.approx((0.003, 0.006, 0.009))
    assert renewed.due == frozenset()


def test_new_text_is_recalled_as_held_by_nobody() -> None:
    """A turn's new chunks were never told about: the memory's answer stops before them,
    as any node server's would; a chunk one node server answered holding is not new."""
    h = Holdings(30.0)
    history = keys(0, 4)
    h.learn(A, history, (("arena",) * 4, (0.0,) * 4), [])
    h.learn(B, history, ((), ()), [])
    turn = history + keys(50, 2)
    assert h.recall(A, turn) == (("arena",) * 4, (0.0,) * 4)
    assert h.recall(B, turn) == ((), ())
    h.learn(A, keys(50, 2), (("arena", "arena"), (0.0, 0.0)))
    assert h.recall(B, turn) == ((), ()), "B answered not holding the first: it stops there"
    assert h.recall(B, keys(50, 2)) is None, "held by A, never asked of B"


def test_a_conversation_back_after_its_memory_expired_is_asked_not_taken_for_new() -> None:
    clock = Clock()
    h = Holdings(5.0, clock=clock)
    prompt = keys(0, 3)
    h.learn(A, prompt, ((), ()), [])
    h.sent(B, prompt)
    clock.now += 60
    assert h.recall(A, prompt) is None and h.recall(B, prompt) is None


def test_an_answer_that_left_before_a_prompt_was_sent_does_not_undo_it() -> None:
    """A lookup of B leaves, the decision does not wait for it and sends the prompt to A
    (now in the shared tier B reads); B's answer, from before, arrives after: it does not
    unlearn what the sending taught about B, and teaches the rest."""
    clock = Clock()
    h = Holdings(30.0, clock=clock)
    system = keys(0, 2)
    h.learn(A, system, (("arena", "arena"), (0.0, 0.0)), ["fs"])
    h.learn(B, system, (("fs", "fs"), (0.002, 0.004)), ["fs"])
    prompt = system + keys(10, 2)
    asked_at = clock.now
    clock.now += 0.01
    h.sent(A, prompt)
    clock.now += 0.01
    h.learn(B, prompt, (("fs", "fs"), (0.002, 0.004)), ["fs"], asked_at)
    tiers, _ = h.recall(B, prompt) or ((), ())
    assert tiers == ("fs",) * 4
    h.learn(B, prompt, (("fs", "fs"), (0.002, 0.004)), ["fs"])
    assert h.recall(B, prompt) == (("fs", "fs"), (0.002, 0.004)), "a fresh answer wins"


def test_a_contradicted_or_forgotten_node_server_is_asked_again() -> None:
    h = Holdings(30.0)
    prompt = keys(0, 3)
    h.learn(B, prompt, ((), ()), [])
    h.sent(A, prompt)
    h.contradicted(A, prompt)
    assert h.recall(A, prompt) is None
    assert h.recall(B, prompt) == ((), ())
    h.forget(B)
    assert h.recall(B, prompt) is None


def test_memory_is_bounded_per_node_server_and_in_what_was_told() -> None:
    """A million distinct chunks sent through one node server: it keeps the newest
    ``max_keys``, the fleet-wide set four times that; the oldest are asked about."""
    h = Holdings(30.0, max_keys=1000)
    for start in range(0, 1_000_000, 1000):
        h.sent(A, keys(start, 1000))
    assert h.size(A) == 1000
    assert len(h._told) == 4000
    assert h.recall(A, keys(999_000, 1000)) == ((ARENA,) * 1000, (0.0,) * 1000)
    assert h.recall(A, keys(0, 1)) == ((), ()), "forgotten everywhere: new again"
    assert h.recall(A, keys(996_500, 1)) is None, "still told about, not remembered at A"


def test_the_same_key_twice_in_one_prompt_and_a_disabled_memory() -> None:
    """An answer that holds a chunk and then stops at the same chunk (no node server's
    answer: both are one chunk) does not unlearn what it said was held."""
    h = Holdings(30.0)
    twice = keys(0, 1) * 2
    h.learn(A, twice, (("arena",), (0.0,)), [])
    assert h.recall(A, twice) == (("arena", "arena"), (0.0, 0.0))
    off = Holdings(0.0)
    off.learn(A, twice, (("arena",), (0.0,)), [])
    off.sent(A, twice)
    assert off.recall(A, twice) is None and off.size(A) == 0


def test_shared_tier_names_from_a_node_server_are_bounded() -> None:
    assert shared_tiers(["fs", "s3"]) == ["fs", "s3"]
    assert shared_tiers([]) == []
    for bad in (None, "fs", [1], [""], ["x" * (MAX_NAME + 1)], ["fs"] * (MAX_SHARED + 1),
                {"fs": 1}):
        assert shared_tiers(bad) is None


def test_lookups_send_only_what_memory_cannot_answer_over_real_http() -> None:
    """Two node servers behind real HTTP. The first decision asks both and learns their
    shared tier; after a prompt was sent to A, its next turn (one new chunk) asks nobody,
    and the answers recalled are what both would have said; a prompt told about but not
    remembered at B asks B only."""
    asked: dict[str, list[list[str]]] = {"a": [], "b": []}

    def handler(name: str, held: set[str]
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def lookup(request: web.Request) -> web.Response:
            ks = (await request.json())["keys"]
            asked[name].append(ks)
            run = 0
            while run < len(ks) and ks[run] in held:
                run += 1
            tier = "arena" if name == "a" else "fs"
            return web.Response(text=json.dumps({
                "tiers": [tier] * run, "arrival_s": [0.0 if name == "a" else 0.003 * (i + 1)
                                                     for i in range(run)],
                "shared": ["fs"]}), content_type="application/json")
        return lookup

    async def main() -> None:
        history = keys(0, 4)
        held_a = {k.hex() for k in history}
        runners, urls = [], []
        for name, held in (("a", held_a), ("b", held_a)):
            app = web.Application()
            app.router.add_post("/v1/lookup", handler(name, held))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        ns = bytes(32)
        memory = Holdings(30.0)
        async with aiohttp.ClientSession() as session:
            lookups = NodeLookups(session, 2.0, holdings=memory)
            first = await lookups.many({(urls[0], ns): history, (urls[1], ns): history})
            assert len(asked["a"]) == len(asked["b"]) == 1
            turn = history + keys(100, 1)
            memory.sent(urls[0], turn)
            nxt = history + keys(100, 1) + keys(200, 1)
            recalled = await lookups.many({(urls[0], ns): nxt, (urls[1], ns): nxt})
            assert len(asked["a"]) == len(asked["b"]) == 1, "nothing sent"
            assert recalled[(urls[0], ns)] == (("arena",) * 5, (0.0,) * 5)
            assert recalled[(urls[1], ns)][0] == ("fs",) * 5
            assert first[(urls[1], ns)][1] == pytest.approx((0.003, 0.006, 0.009, 0.012))
            memory.contradicted(urls[1], nxt)
            await lookups.many({(urls[0], ns): nxt, (urls[1], ns): nxt})
            assert (len(asked["a"]), len(asked["b"])) == (1, 2), "only B asked again"
        for runner in runners:
            await runner.cleanup()
    asyncio.run(main())


def test_an_old_pace_is_renewed_in_the_background_without_holding_a_decision() -> None:
    """A node server whose remembered pace is over ``PACE_S`` old is asked again, but the
    decision returns on the memory at once: the server here holds its answer until released,
    and three decisions meanwhile send one lookup between them. Its answer renews the pace
    (a fresh recall has the new arrivals); past ``STALE_PACE_S`` a decision waits for it."""
    clock = Clock()
    asked: list[list[str]] = []
    release = asyncio.Event()

    async def lookup(request: web.Request) -> web.Response:
        ks = (await request.json())["keys"]
        asked.append(ks)
        await release.wait()
        return web.Response(text=json.dumps({
            "tiers": ["fs"] * len(ks), "arrival_s": [0.01 * (i + 1) for i in range(len(ks))],
            "shared": ["fs"]}), content_type="application/json")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/lookup", lookup)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        prompt, ns = keys(0, 3), bytes(32)
        memory = Holdings(60.0, clock=clock)
        memory.learn(url, prompt, (("fs",) * 3, (0.002, 0.004, 0.006)), ["fs"])
        registry = CollectorRegistry()
        refreshed = Counter("refreshed", "", registry=registry)

        def count() -> float | None:
            return registry.get_sample_value("refreshed_total")
        async with aiohttp.ClientSession() as session:
            lookups = NodeLookups(session, 5.0, holdings=memory, refreshed=refreshed)
            clock.now += PACE_S + 0.5
            for _ in range(3):
                got = await asyncio.wait_for(lookups.many({(url, ns): prompt}), 1.0)
                assert got[(url, ns)] == (("fs",) * 3, (0.002, 0.004, 0.006))
            deadline = time.monotonic() + 5
            while not asked:
                assert time.monotonic() < deadline, "the old pace was never asked again"
                await asyncio.sleep(0.01)
            assert len(asked) == 1 and count() == 1.0
            release.set()
            while memory.recall(url, prompt) is None:
                assert time.monotonic() < deadline, "the answer never renewed the pace"
                await asyncio.sleep(0.01)
            assert memory.recall(url, prompt) == (("fs",) * 3, pytest.approx((0.01, 0.02, 0.03)))
            clock.now += PACE_S + 0.5
            while len(asked) < 2:  # once the first refresh's task is done, asked again
                assert time.monotonic() < deadline, "a renewed pace grown old is not renewed"
                await asyncio.wait_for(lookups.many({(url, ns): prompt}), 1.0)
                await asyncio.sleep(0.01)
            while memory.recall(url, prompt) is None:
                assert time.monotonic() < deadline, "the second answer never came"
                await asyncio.sleep(0.01)
            assert count() == 2.0
            clock.now += STALE_PACE_S + 1
            got = await asyncio.wait_for(lookups.many({(url, ns): prompt}), 5.0)
            assert len(asked) == 3, "too old: asked and waited for"
            assert got[(url, ns)] == (("fs",) * 3, pytest.approx((0.01, 0.02, 0.03)))
        await runner.cleanup()
    asyncio.run(main())


def test_closing_cancels_a_refresh_still_out_without_counting_a_failure() -> None:
    """A background refresh whose node server has not answered when the router closes is
    cancelled by ``NodeLookups.close`` (before the session closes), not failed against a
    closed session: the node server's failures stay at zero."""
    clock = Clock()
    arrived = asyncio.Event()

    async def lookup(request: web.Request) -> web.Response:
        arrived.set()
        await asyncio.sleep(30)
        return web.Response(status=500)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/lookup", lookup)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        prompt = keys(0, 2)
        memory = Holdings(60.0, clock=clock)
        memory.learn(url, prompt, (("fs",) * 2, (0.002, 0.004)), ["fs"])
        registry = CollectorRegistry()
        failures = Counter("failures", "", ["server"], registry=registry)
        async with aiohttp.ClientSession() as session:
            lookups = NodeLookups(session, 60.0, failures, holdings=memory)
            clock.now += PACE_S + 0.5
            await asyncio.wait_for(lookups.many({(url, bytes(32)): prompt}), 1.0)
            await asyncio.wait_for(arrived.wait(), 5.0)
            await asyncio.wait_for(lookups.close(), 5.0)
        assert registry.get_sample_value("failures_total", {"server": url}) is None
        await runner.cleanup()
    asyncio.run(main())


def test_a_conversation_on_a_shared_tier_stops_asking_node_servers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two real node servers sharing an ``fs`` tier, stub engines that store what they
    compute, the router in front, one conversation of five turns (a new chunk each). The
    first turns ask (nothing remembered; then a node server whose shared tier's pace it has
    not answered); the last asks none, and every turn's predicted source of its prompt is the
    one the engine reports. With the memory off, every turn asks. (A lower tier's pace is
    held longer than in production: turns here wait for the journal between them.)"""
    monkeypatch.setattr(holdings, "PACE_S", 60.0)
    monkeypatch.setattr(holdings, "STALE_PACE_S", 60.0)
    prefix = [9000 + t for t in range(40 * 16)]

    async def conversation(memory_s: float) -> tuple[list[float], dict[bool, float]]:
        root = tmp_path / f"m{memory_s}"
        nodes = [node(root / n, root / "shared") for n in "ab"]
        try:
            async with stubs(2) as backends:
                servers = with_engines(backends, nodes, speed=4000)
                # the stub engines have no device cache: the router's device history must
                # not outlive a turn
                cost = CostModel(lookup_timeout_s=2.0, lookup_memory_s=memory_s,
                                 device_ttl_s=0.01)
                async with running_router(router_config(
                        backends, strategy="cache", kvtier_servers=servers,
                        cost=cost)) as router, aiohttp.ClientSession() as s:
                    await asyncio.sleep(0.3)  # namespaces read
                    url = f"http://127.0.0.1:{router.port}/v1/completions"
                    registry = router.metrics.registry
                    asked = []
                    prompt = prefix
                    for turn in range(5):
                        prompt = prompt + [turn + 1] * 16
                        status, _, _ = await post(s, url, completion(prompt))
                        assert status == 200
                        asked.append(registry.get_sample_value(
                            "kvtier_router_lookup_seconds_count") or 0.0)
                        deadline = time.monotonic() + 10
                        while any(len(held_by(n, prompt)) < len(prompt) // 16 for n in nodes):
                            assert time.monotonic() < deadline, "journal never caught up"
                            await asyncio.sleep(0.05)
                    matched: dict[bool, float] = {True: 0.0, False: 0.0}
                    for metric in registry.collect():
                        for sample in metric.samples:
                            if sample.name == "kvtier_router_hit_source_total":
                                same = sample.labels["predicted"] == sample.labels["actual"]
                                matched[same] += sample.value
                    return asked, matched
        finally:
            for n in nodes:
                n.stop()

    asked, matched = asyncio.run(conversation(30.0))
    assert asked[-1] == asked[-2], f"the last turn sent no lookup: {asked}"
    assert matched == {True: 5.0, False: 0.0}, "each turn's source as predicted"
    asked, matched = asyncio.run(conversation(0.0))
    assert asked == [1.0, 2.0, 3.0, 4.0, 5.0], "without memory every turn asks"
    assert matched == {True: 5.0, False: 0.0}
