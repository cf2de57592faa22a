"""Active health checks, every ``health_interval_s``, carrying the backends' API key.

Per backend: ``GET /health`` (a 200 within the interval keeps it in; anything else takes it
out at once, the next 200 brings it back), then ``GET /v1/models`` (what it serves, merged into
the router's own /v1/models) and ``GET /metrics`` (its queue and device cache size). Per
node server: ``GET /v1/namespaces`` (what keys its engines compute; with the node token). A
request that cannot reach a backend also takes it out (:meth:`BackendPool.set_health`),
without waiting for the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvtier.prom import MAX_CHARS
from kvtier.router.backends import Backend, BackendPool
from kvtier.router.keys import NamespaceInfo, Renderers
from kvtier.router.redact import redact_url
from kvtier.router.scrape import engine_gauges

log = logging.getLogger("kvtier.router")
MAX_JSON_BYTES = 4 << 20
"""The most of a backend's ``/v1/models`` or a node server's ``/v1/namespaces`` answer that
is read; a larger one counts as no answer (a page may be huge or endless)."""
MAX_MODELS = 256
"""Models one backend may list (the rest are left out of the router's /v1/models)."""
MAX_HEALTH_BYTES = 64 << 10


class HealthMonitor:
    def __init__(self, pool: BackendPool, session: aiohttp.ClientSession, interval_s: float,
                 backend_headers: dict[str, str], renderers: Renderers,
                 node_headers: dict[str, str] | None = None) -> None:
        self.pool = pool
        self.session = session
        self.interval_s = interval_s
        self.headers = backend_headers
        self.node_headers = node_headers or {}
        self.renderers = renderers
        self._said_too_large: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._recheck: asyncio.Task[None] | None = None

    async def recheck_out(self) -> None:
        """Check the backends that are out now, once for all callers at the same time (a
        burst of requests finding none up makes one round, not one each)."""
        if self._recheck is None or self._recheck.done():
            out = [b for b in self.pool if not b.healthy]
            self._recheck = asyncio.create_task(self._check_some(out))
        await asyncio.shield(self._recheck)

    async def check_some(self, backends: Sequence[Backend]) -> None:
        """Check ``backends`` now (newcomers: they take requests once they answer)."""
        await self._check_some(backends)

    async def _check_some(self, backends: Sequence[Backend]) -> None:
        try:
            await asyncio.gather(*(self.check(b) for b in backends))
        except Exception:  # a failed recheck leaves them out; the next round tries again
            log.exception("recheck of the backends that are out failed")

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for task in (self._task, self._recheck):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # one bad round must not end health checking
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.pool))

    async def check(self, backend: Backend) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s))
        try:
            async with self.session.get(f"{backend.url}/health", headers=self.headers,
                                        timeout=timeout) as resp:
                await _capped_text(resp, MAX_HEALTH_BYTES)
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, why = False, f"/health: {type(exc).__name__}: {exc}"
        if ok:
            await asyncio.gather(self._models(backend, timeout),
                                 self._gauges(backend, timeout),
                                 self._namespaces(backend, timeout))
        self.pool.set_health(backend, ok, "ok" if ok else why)

    async def _models(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        doc = await self._get_json(f"{backend.url}/v1/models", timeout, self.headers)
        if isinstance(doc, dict) and isinstance(doc.get("data"), list):
            backend.models = [m for m in doc["data"] if isinstance(m, dict)][:MAX_MODELS]

    async def _gauges(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        try:
            async with self.session.get(f"{backend.url}/metrics", headers=self.headers,
                                        timeout=timeout) as resp:
                if resp.status != 200:
                    return
                text = await _capped_text(resp, MAX_CHARS)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return
        gauges = engine_gauges(text)
        backend.load.observe(gauges.running, gauges.waiting, time.monotonic())
        if gauges.device_tokens:
            backend.device_tokens = gauges.device_tokens

    async def _namespaces(self, backend: Backend, timeout: aiohttp.ClientTimeout) -> None:
        if backend.node_url is None:
            return
        doc = await self._get_json(f"{backend.node_url}/v1/namespaces", timeout,
                                   self.node_headers)
        if not isinstance(doc, list):
            return  # keep what it said last: an engine's keys do not change while it runs
        spaces = [ns for ns in (NamespaceInfo.parse(d) for d in doc if isinstance(d, dict))
                  if ns is not None]
        if spaces != backend.namespaces:
            backend.namespaces = spaces
            for ns in spaces:
                self.renderers.prefetch(ns.tokenizer)

    def _too_large(self, url: str) -> None:
        if url not in self._said_too_large and len(self._said_too_large) < 1024:
            self._said_too_large.add(url)
            log.warning("%s answered more than %d bytes; ignored (said once)",
                        redact_url(url), MAX_JSON_BYTES)

    async def _get_json(self, url: str, timeout: aiohttp.ClientTimeout,
                        headers: dict[str, str]) -> Any:
        try:
            async with self.session.get(url, headers=headers, timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                raw = bytearray()
                async for chunk in resp.content.iter_chunked(1 << 16):
                    raw += chunk
                    if len(raw) > MAX_JSON_BYTES:
                        self._too_large(url)
                        return None
            return json.loads(raw)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError):
            return None  # RecursionError: JSON nested deeper than the parser goes


async def _capped_text(resp: aiohttp.ClientResponse, limit: int) -> str:
    """At most about ``limit`` bytes of the body (a backend's page may be huge or endless);
    bytes that are not UTF-8 are replaced, the parser then skips their lines."""
    parts: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts).decode("utf-8", errors="replace")
