"""Asking node servers what they hold of a prompt (``POST /v1/lookup``), in parallel.

A server that does not answer within ``timeout_s`` (or answers with an error) counts as
holding nothing: a lookup must never make routing slower than routing without it. A
strategy need not wait for every answer: :meth:`NodeLookups.many` returns as soon as the
answers in hand settle the choice (the ``cache`` strategy's bound), and sends none when
what the router knows settles it already. With a
node token every lookup carries ``Authorization: Bearer TOKEN``; failures are counted under
the server's URL with its credentials redacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from prometheus_client import Counter, Histogram

from kvtier.keys import ChunkKey
from kvtier.router.redact import redact_url

log = logging.getLogger("kvtier.router")

Answer = tuple[tuple[str, ...], tuple[float, ...]]
NOTHING: Answer = ((), ())


class NodeLookups:
    def __init__(self, session: aiohttp.ClientSession, timeout_s: float,
                 failures: Counter | None = None, headers: Mapping[str, str] | None = None,
                 took: Histogram | None = None, spared: Counter | None = None) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures = failures
        self.headers = dict(headers or {})
        self.took = took
        self.spared = spared
        self._background: set[asyncio.Future[Answer]] = set()

    async def many(self, asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]],
                   enough: Callable[[Mapping[tuple[str, bytes], Answer]], bool] | None = None
                   ) -> dict[tuple[str, bytes], Answer]:
        """One lookup per (node server URL, namespace) pair, all at once. Returns when all
        have answered, or as soon as ``enough(answers so far)`` says the others cannot
        change anything (asked first with none: then none is sent). Those not waited for
        finish in the background (bounded by ``timeout_s``; their connections go back to
        the pool). Both are counted in ``spared``; the time waited goes to ``took``."""
        if enough is not None and asks and enough({}):
            if self.spared is not None:
                self.spared.inc(len(asks))
            return {}
        start = time.perf_counter()
        tasks = {asyncio.ensure_future(self.one(ask[0], keys)): ask
                 for ask, keys in asks.items()}
        answers: dict[tuple[str, bytes], Answer] = {}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    answers[tasks[task]] = task.result()
                if pending and enough is not None and enough(answers):
                    break
        finally:
            for task in pending:  # not cancelled: that would close their connections
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if pending and self.spared is not None:
            self.spared.inc(len(pending))
        if self.took is not None and tasks:
            self.took.observe(time.perf_counter() - start)
        return answers

    async def one(self, url: str, keys: Sequence[ChunkKey]) -> Answer:
        if not keys:
            return NOTHING
        body = {"keys": [k.hex() for k in keys]}
        try:
            async with self.session.post(f"{url}/v1/lookup", json=body, headers=self.headers,
                                         timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                doc = await resp.json(content_type=None)
            tiers = tuple(str(t) for t in doc["tiers"])
            arrival = tuple(float(a) for a in doc.get("arrival_s") or [0.0] * len(tiers))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError,
                TypeError) as exc:
            if self.failures is not None:
                self.failures.labels(redact_url(url)).inc()
            log.debug("lookup on %s failed: %s: %s", redact_url(url), type(exc).__name__, exc)
            return NOTHING
        n = min(len(tiers), len(arrival))
        return tiers[:n], arrival[:n]
