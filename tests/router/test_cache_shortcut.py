"""The ``cache`` strategy measures whether deciding pays: while full decisions gain less
time to first token than they take (every instance holds every prompt equally, as with a
fast shared tier), it routes by queue and crowding alone, keeps deciding one request in
``SAMPLE_EVERY`` to keep measuring, and goes back to deciding every request as soon as a
decision would gain more (a prompt only one instance holds)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

import pytest
from test_cache_settle import CHUNK, arena, request, setup

from kvtier.router.config import CostModel
from kvtier.router.lookup import NOTHING, Answer
from kvtier.router.strategies import cache
from kvtier.router.strategies.cache import CacheAware, Worth


def test_worth_takes_the_shortcut_only_while_decisions_gain_less_than_they_take() -> None:
    worth = Worth()
    for _ in range(cache.MIN_DECISIONS - 1):
        assert worth.add(0.001, 0.005) is None
    assert not worth.take_shortcut(), "not before MIN_DECISIONS are measured"
    assert worth.add(0.001, 0.005) is True
    taken = [worth.take_shortcut() for _ in range(4 * cache.SAMPLE_EVERY)]
    assert taken.count(False) == 4, "one request in SAMPLE_EVERY still decided in full"
    # one decision that would have saved a recompute outweighs many small ones
    assert worth.add(0.3, 0.005) is False
    assert not worth.take_shortcut()


def decide(n: int, answers: dict[str, tuple[float, Answer]], shortcut: bool = True
           ) -> tuple[Counter[str], list[str], CacheAware]:
    async def main() -> tuple[Counter[str], list[str], CacheAware]:
        strategy, pool, lookups = setup(answers)
        strategy.ctx.config = dataclasses.replace(
            strategy.ctx.config, cost=CostModel(shortcut=shortcut))
        reasons: Counter[str] = Counter()
        for i in range(n):
            req = request(10 * CHUNK + 3)
            assert req.body is not None
            req.body["prompt"][0] = 10_000 + i  # each prompt its own
            decision = await strategy.choose(req, list(pool))
            reasons[decision.reason] += 1
        await asyncio.sleep(0.05)  # the shortcut's keys, computed after it
        return reasons, lookups.asked, strategy
    return asyncio.run(main())


def test_a_fleet_where_every_instance_holds_every_prompt_takes_the_shortcut(
        caplog: pytest.LogCaptureFixture) -> None:
    answers = {"http://node-a": (0.002, arena(10)), "http://node-b": (0.002, arena(10))}
    with caplog.at_level(logging.INFO, "kvtier.router"):
        reasons, asked, strategy = decide(200, answers)
    full = 200 - reasons["shortcut"]
    assert reasons["shortcut"] > 140, reasons
    assert full < cache.MIN_DECISIONS + 200 // cache.SAMPLE_EVERY + 2
    assert len(asked) == 2 * full, "a shortcut asks no node server"
    held = [strategy.ctx.history.size(i) for i in (0, 1)]
    # a shortcut's prompt goes into the device history as the router records a decision's
    assert sum(held) == reasons["shortcut"] * 10
    logged = [r for r in caplog.records if "routing by queue and crowding" in r.getMessage()]
    assert len(logged) == 1


def test_a_fleet_where_one_instance_holds_the_prompts_decides_every_request() -> None:
    answers = {"http://node-a": (0.002, arena(10)), "http://node-b": (0.002, NOTHING)}
    reasons, _, _ = decide(120, answers)
    assert reasons["shortcut"] == 0 and reasons["affinity"] == 120


def test_always_decide_turns_the_shortcut_off() -> None:
    answers = {"http://node-a": (0.002, arena(10)), "http://node-b": (0.002, arena(10))}
    reasons, asked, _ = decide(100, answers, shortcut=False)
    assert reasons["shortcut"] == 0 and len(asked) == 200
