"""Keeping the router's backends those a source lists (``--backends-dns``, ``--backends-file``).

Every ``interval_s`` the source is asked again (:mod:`kvtier.router.sources`) and the pool
made to match (:meth:`BackendPool.update`): a newcomer is health-checked at once and takes
requests as soon as it answers; one no longer listed is drained (no new requests, those in
flight finish). A source that fails keeps the last good set; that is logged once when it
starts failing (or fails differently) and once when it answers again. No restart, and no
request is lost that had not reached a backend that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from kvtier.router.backends import Backend, BackendPool, Change
from kvtier.router.config import DiscoveryConfig
from kvtier.router.history import DeviceHistory
from kvtier.router.holdings import Holdings
from kvtier.router.lookup import NodeLookups
from kvtier.router.metrics import RouterMetrics
from kvtier.router.redact import redact_url
from kvtier.router.sources import DnsSource, FileSource, Resolver, Source, SourceFailed

log = logging.getLogger("kvtier.router")
Joined = Callable[[Sequence[Backend]], Awaitable[None]]


def make_source(config: DiscoveryConfig, resolve: Resolver | None = None) -> Source:
    if config.dns is not None:
        if resolve is not None:
            return DnsSource(config.dns, config.node_port, config.max_backends,
                             config.timeout_s, resolve)
        return DnsSource(config.dns, config.node_port, config.max_backends, config.timeout_s)
    assert config.file is not None  # DiscoveryConfig names exactly one source
    return FileSource(config.file, config.node_port, config.max_backends, config.timeout_s)


class Discovery:
    def __init__(self, source: Source, pool: BackendPool, interval_s: float,
                 metrics: RouterMetrics, on_joined: Joined) -> None:
        self.source = source
        self.pool = pool
        self.interval_s = interval_s
        self.metrics = metrics
        self.on_joined = on_joined
        self.failing: str | None = None
        """Why the last poll failed; None when it answered."""
        self.dropped = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Ask once (the router listens with what that found), then every interval."""
        await self.poll()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.source.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # one bad round must not end discovery
                log.exception("discovery round failed")

    async def poll(self) -> Change | None:
        """Ask the source and apply what it says; None when it failed (nothing changed)."""
        try:
            found = await self.source.found()
        except SourceFailed as exc:
            self.metrics.discovery_failures.inc()
            self._failed(str(exc))
            return None
        if self.failing is not None:
            log.info("discovery: %s answers again", self.source.what)
            self.failing = None
        if found.dropped != self.dropped:
            self.dropped = found.dropped
            if found.dropped:
                log.warning("discovery: %s lists %d backends more than --max-backends %d; "
                            "those are left out", self.source.what, found.dropped,
                            len(found.backends))
        change = self.pool.update(found.backends)
        self.metrics.discovered.set(len(self.pool))
        if change.joined:
            self.metrics.membership.labels("join").inc(len(change.joined))
        if change.left:
            self.metrics.membership.labels("leave").inc(len(change.left))
        if change:
            log.info("discovery: %s lists %d backends (%d joined, %d left%s)",
                     self.source.what, len(self.pool), len(change.joined), len(change.left),
                     f", {len(change.moved)} with a new node server" if change.moved else "")
        if change.joined:
            await self.on_joined(change.joined)
        return change

    def _failed(self, why: str) -> None:
        if why != self.failing:
            log.warning("discovery: %s failed (%s); keeping the %d backends it listed last",
                        self.source.what, why, len(self.pool))
        self.failing = why


class MemberWatch:
    """What the router keeps per backend, kept to the members (a :class:`PoolWatcher`): a
    newcomer shows as out until checked; once one that left is gone, its series leave
    /metrics and its device history, its node server's holdings and lookup breaker are
    forgotten (churn must not grow them for ever)."""

    def __init__(self, pool: BackendPool, metrics: RouterMetrics, history: DeviceHistory,
                 holdings: Holdings) -> None:
        self.pool = pool
        self.metrics = metrics
        self.history = history
        self.holdings = holdings
        self.lookups: NodeLookups | None = None
        """Set once the router has made them (they need its HTTP session)."""

    def joined(self, backend: Backend) -> None:
        self.metrics.up.labels(backend.name).set(0)  # out until its first health check

    def moved(self, backend: Backend) -> None:
        self._keep_nodes()  # what the old node server held is no longer this backend's

    def left(self, backend: Backend) -> None:
        self.metrics.up.labels(backend.name).set(0)
        self._keep_nodes()

    def gone(self, backend: Backend) -> None:
        self.history.forget(backend.index)
        node = backend.node_url
        shared = node is not None and any(
            b.node_url == node for b in [*self.pool, *self.pool.leaving.values()]
            if b is not backend)
        self.metrics.forget_backend(backend.name, redact_url(node)
                                    if node and not shared else None)
        self._keep_nodes()

    def _keep_nodes(self) -> None:
        nodes = [b.node_url for b in [*self.pool, *self.pool.leaving.values()] if b.node_url]
        self.holdings.keep(nodes)
        if self.lookups is not None:
            self.lookups.keep(nodes)
        self.metrics.draining.set(len(self.pool.leaving))
