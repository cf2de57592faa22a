"""Asking node servers what they hold of a prompt (``POST /v1/lookup``), in parallel.

A server that does not answer within ``timeout_s`` (or answers with an error) counts as
holding nothing: a lookup must never make routing slower than routing without it. With a
node token every lookup carries ``Authorization: Bearer TOKEN``; failures are counted under
the server's URL with its credentials redacted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence

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
                 took: Histogram | None = None) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.failures = failures
        self.headers = dict(headers or {})
        self.took = took

    async def many(self, asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]]
                   ) -> dict[tuple[str, bytes], Answer]:
        """One lookup per (node server URL, namespace) pair, all at once; the time they
        took together goes to ``took``."""
        items = list(asks.items())
        start = time.perf_counter()
        answers = await asyncio.gather(*(self.one(url, keys) for (url, _), keys in items))
        if self.took is not None and items:
            self.took.observe(time.perf_counter() - start)
        return {ask: answer for (ask, _), answer in zip(items, answers, strict=True)}

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
