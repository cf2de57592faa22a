"""Driving the workload: closed loop (N users in flight) or open loop (Poisson arrivals).

Turns are taken in schedule order (:meth:`Workload.schedule`). A user's turn is sent only once
its previous one is answered (the answer is part of the prompt), so in the open loop a turn
whose user is still waiting goes out as soon as the answer arrives (counted in
``RunOutcome.delayed``). Warm-up rounds run first, to completion; then the endpoint's counters
are read and the measured rounds start on a fresh clock (open loop: a fresh arrival process).
In the closed loop a phase's clients start one after another, each once the one before it
has its first token: clients that all started at once would send in step for their first
several turns (equal prompts take equal times), and those collisions, a few seconds of a
run, would be all its p99 said.
A failed request's answer is replaced by synthetic text of the planned length, so the user's
later turns keep their shape.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvtier.bench.openai_client import Endpoint, RequestResult, RequestSpec
from kvtier.bench.textgen import text_of
from kvtier.bench.tokens import TokenCounter
from kvtier.bench.workload import Turn, Workload
from kvtier.errors import ConfigError

Mode = Literal["closed", "open"]


@dataclass(frozen=True)
class LoadConfig:
    mode: Mode = "closed"
    concurrency: int = 1
    """Closed loop: requests in flight. Open loop: at most this many (0: no cap)."""
    qps: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode == "open" and (self.qps is None or self.qps <= 0):
            raise ConfigError("--qps must be positive")
        if self.mode == "closed" and self.concurrency < 1:
            raise ConfigError("--concurrency must be at least 1")
        if self.concurrency < 0:
            raise ConfigError("--concurrency cannot be negative")


@dataclass
class RunOutcome:
    results: list[RequestResult] = field(default_factory=list)
    measured_start_s: float = 0.0
    measured_end_s: float = 0.0
    delayed: int = 0
    counters_before: dict[str, float] | None = None
    counters_after: dict[str, float] | None = None

    @property
    def duration_s(self) -> float:
        return self.measured_end_s - self.measured_start_s

    def measured(self) -> list[RequestResult]:
        return [r for r in self.results if not r.warmup]


Counters = Callable[[], Awaitable[dict[str, float] | None]]


class Runner:
    def __init__(self, workload: Workload, endpoint: Endpoint, load: LoadConfig,
                 counter: TokenCounter, on_result: Callable[[RequestResult], None] | None = None,
                 counters: Counters | None = None) -> None:
        self.workload = workload
        self.endpoint = endpoint
        self.load = load
        self.counter = counter
        self.on_result = on_result
        self.counters = counters
        users = range(workload.config.num_users)
        self.answers: dict[int, list[str]] = {u: [] for u in users}
        rounds = workload.config.num_rounds
        self.done = {(u, r): asyncio.Event() for u in users for r in range(rounds)}
        self.outcome = RunOutcome()

    async def run(self) -> RunOutcome:
        schedule = self.workload.schedule()
        warm = [t for t in schedule if t.warmup]
        if warm:
            await self._phase(warm, seed_tag="warmup")
        if self.counters:
            self.outcome.counters_before = await self.counters()
        self.outcome.measured_start_s = self.endpoint.now()
        await self._phase([t for t in schedule if not t.warmup], seed_tag="measured")
        self.outcome.measured_end_s = self.endpoint.now()
        if self.counters:
            self.outcome.counters_after = await self.counters()
        return self.outcome

    async def _phase(self, turns: Sequence[Turn], seed_tag: str) -> None:
        if self.load.mode == "closed":
            await self._closed(turns)
        else:
            await self._open(turns, random.Random(f"{self.load.seed}:{seed_tag}"))

    async def _closed(self, turns: Sequence[Turn]) -> None:
        queue = iter(turns)
        started = [asyncio.Event() for _ in range(min(self.load.concurrency, len(turns)))]

        async def worker(k: int) -> None:
            if k:
                await started[k - 1].wait()
            try:
                for turn in queue:
                    await self._turn(turn, started[k])
            finally:
                started[k].set()  # none taken (or a failure): the next one need not wait

        await asyncio.gather(*(worker(k) for k in range(len(started))))

    async def _open(self, turns: Sequence[Turn], rng: random.Random) -> None:
        assert self.load.qps is not None
        cap = asyncio.Semaphore(self.load.concurrency) if self.load.concurrency else None
        start = time.perf_counter()
        at = 0.0
        tasks = []
        for turn in turns:
            at += rng.expovariate(self.load.qps)
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(self._capped(turn, cap)))
        await asyncio.gather(*tasks)

    async def _capped(self, turn: Turn, cap: asyncio.Semaphore | None) -> None:
        if cap is None:
            await self._turn(turn)
            return
        async with cap:
            await self._turn(turn)

    async def _turn(self, turn: Turn, first_token: asyncio.Event | None = None) -> None:
        if turn.round > 0:
            previous = self.done[(turn.user, turn.round - 1)]
            if not previous.is_set():
                self.outcome.delayed += 1
                await previous.wait()
        answers = self.answers[turn.user]
        conv = self.workload.conversations[turn.user]
        max_tokens = conv.answer_tokens[turn.round]
        if self.endpoint.config.api == "chat":
            spec = RequestSpec(turn.user, turn.round, turn.warmup, max_tokens,
                               messages=self.workload.messages(turn.user, turn.round, answers))
        else:
            spec = RequestSpec(turn.user, turn.round, turn.warmup, max_tokens,
                               prompt=self.workload.prompt(turn.user, turn.round, answers))
        result = await self.endpoint.send(spec, first_token)
        answers.append(result.text if result.ok and result.text else
                       self._fallback(turn, max_tokens))
        result.text = ""  # the answer lives on in the conversation, not in the results
        self.outcome.results.append(result)
        self.done[(turn.user, turn.round)].set()
        if self.on_result:
            self.on_result(result)

    def _fallback(self, turn: Turn, tokens: int) -> str:
        rng = random.Random(f"kvtier-fallback:{self.workload.config.seed}:{turn.user}:"
                            f"{turn.round}")
        return text_of(self.counter, tokens, rng)
