"""The backends behind the router: where they are, whether they are up, what they serve.

A :class:`Backend` owns what the health monitor learns about it (up or down, its models, its
queue and device cache size from vLLM's /metrics, the namespaces its node server lists) and
its :class:`~kvtier.router.load.BackendLoad`. The pool hands strategies the healthy
candidates for a model.

The pool's members change when discovery says so (:meth:`BackendPool.update`)::

    (new URL) ──join──► MEMBER ──leave──► LEAVING ──last request in flight ends──► GONE
                          ▲                  │ (none in flight: GONE at once)
                          └─────rejoin───────┘

Only members are candidates or health-checked; a leaving backend finishes what it has.
Indices are never reused, so what is keyed by them (device history, a request's tried
backends) cannot mistake a newcomer for one that left.
"""

from __future__ import annotations

import enum
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.errors import IntegrityError
from kvtier.router.config import RouterConfig
from kvtier.router.keys import NamespaceInfo, pick_namespace
from kvtier.router.load import BackendLoad, StepModel
from kvtier.router.redact import redact_url
from kvtier.router.sources import BackendSpec

log = logging.getLogger("kvtier.router")


class Membership(enum.Enum):
    MEMBER = "member"
    LEAVING = "leaving"
    """Left the discovered set: no new requests; the ones in flight finish."""
    GONE = "gone"


class PoolWatcher(Protocol):
    """Told of membership changes (the router: metrics, device history, node memory)."""

    def joined(self, backend: Backend) -> None: ...
    def moved(self, backend: Backend) -> None:
        """Its node server's URL changed."""
    def left(self, backend: Backend) -> None: ...
    def gone(self, backend: Backend) -> None: ...


@dataclass(frozen=True)
class Change:
    joined: tuple[Backend, ...] = ()
    left: tuple[Backend, ...] = ()
    moved: tuple[Backend, ...] = ()
    """Members whose node server's URL changed."""

    def __bool__(self) -> bool:
        return bool(self.joined or self.left or self.moved)


@dataclass(eq=False)
class Backend:
    index: int
    url: str
    node_url: str | None
    load: BackendLoad
    healthy: bool = False
    reason: str = "not checked yet"
    models: list[dict[str, Any]] = field(default_factory=list)
    namespaces: list[NamespaceInfo] = field(default_factory=list)
    device_tokens: int | None = None
    """vLLM's device KV cache in tokens (num_gpu_blocks x block_size), from its /metrics."""
    membership: Membership = Membership.MEMBER
    active: int = 0
    """Requests the router has at it now (attempts, from choosing it to their last byte)."""

    @property
    def name(self) -> str:
        """The URL as shown (names, labels, headers, logs): credentials redacted."""
        return redact_url(self.url)

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or any(m.get("id") == model
                                                       for m in self.models)

    def namespace_for(self, model: str | None) -> NamespaceInfo | None:
        return pick_namespace(self.namespaces, model)


class BackendPool:
    def __init__(self, config: RouterConfig) -> None:
        cost = config.cost
        self.steps = StepModel(cost.speed_alpha)
        """Decode step time against streams, of every backend's answers (one model: see
        :mod:`kvtier.router.load`)."""
        self._cost = cost
        self._indices = itertools.count()
        self.backends: list[Backend] = []
        """The members, in the order they joined."""
        self.leaving: dict[str, Backend] = {}
        """Backends that left with requests in flight, by URL."""
        self.version = 0
        """Changes with every change of members (strategies rebuild their rings)."""
        for url, node in zip(config.backends, config.kvtier_servers, strict=True):
            self.backends.append(self._new(url, node))
        self.listeners: list[Any] = []
        """Called with (backend, healthy) on every change (metrics, device history)."""
        self.watchers: list[PoolWatcher] = []

    def _new(self, url: str, node_url: str | None) -> Backend:
        load = BackendLoad(self._cost.prefill_tokens_per_s, self._cost.speed_alpha, self.steps)
        return Backend(next(self._indices), url, node_url, load)

    # ------------------------------------------------------------------ membership

    def update(self, specs: Sequence[BackendSpec]) -> Change:
        """Make the members exactly ``specs`` (URLs unique): newcomers join (out until their
        first health check), members not listed leave, a leaving one listed again rejoins
        (out, too, until its next health check)."""
        wanted = {spec.url: spec for spec in specs}
        left = tuple(b for b in self.backends if b.url not in wanted)
        for backend in left:
            self._leave(backend)
        members = {b.url: b for b in self.backends}
        joined: list[Backend] = []
        moved: list[Backend] = []
        for spec in wanted.values():
            member = members.get(spec.url)
            if member is None:
                back = self.leaving.pop(spec.url, None)
                member = back if back is not None else self._new(spec.url, spec.node_url)
                if back is not None:  # what it said while leaving was not heeded: stale
                    back.healthy, back.reason = False, "rejoined: out until its next check"
                member.membership = Membership.MEMBER
                self.backends.append(member)
                joined.append(member)
            if member.node_url != spec.node_url:
                member.node_url, member.namespaces = spec.node_url, []
                moved.append(member)
        change = Change(tuple(joined), left, tuple(moved))
        if change:
            self.version += 1
        for backend in joined:
            for watcher in self.watchers:
                watcher.joined(backend)
        for backend in moved:
            for watcher in self.watchers:
                watcher.moved(backend)
        for backend in left:
            for watcher in self.watchers:
                watcher.left(backend)
            if backend.active == 0:
                self._gone(backend)
        return change

    def _leave(self, backend: Backend) -> None:
        self.backends.remove(backend)
        backend.membership = Membership.LEAVING
        self.leaving[backend.url] = backend
        log.info("backend %s left the discovered set: no new requests%s", backend.name,
                 f", {backend.active} in flight finish" if backend.active else "")

    def _gone(self, backend: Backend) -> None:
        if self.leaving.get(backend.url) is backend:
            del self.leaving[backend.url]
        backend.membership = Membership.GONE
        backend.healthy, backend.reason = False, "left"
        backend.load.clear()
        for watcher in self.watchers:
            watcher.gone(backend)

    def started(self, backend: Backend) -> None:
        backend.active += 1

    def finished(self, backend: Backend) -> None:
        """A request at ``backend`` ended; the last one at a leaving backend ends its drain."""
        backend.active -= 1
        if backend.active == 0 and backend.membership is Membership.LEAVING:
            log.info("backend %s drained", backend.name)
            self._gone(backend)

    def check_integrity(self) -> None:
        urls = [b.url for b in self.backends]
        problems = []
        if len(set(urls)) != len(urls):
            problems.append(f"a URL twice among the members: {urls}")
        if any(b.membership is not Membership.MEMBER for b in self.backends):
            problems.append("a member not marked MEMBER")
        for url, b in self.leaving.items():
            if b.url != url or b.membership is not Membership.LEAVING or b.active <= 0:
                problems.append(f"{b.name}: leaving, {b.membership.name}, {b.active} active")
            if url in urls:
                problems.append(f"{b.name}: both leaving and a member")
        if any(b.active < 0 for b in [*self.backends, *self.leaving.values()]):
            problems.append("a negative count of requests in flight")
        if problems:
            raise IntegrityError("backend pool: " + "; ".join(problems))

    # ------------------------------------------------------------------ health

    def share_speed(self) -> None:
        """A backend whose prefill speed has not been measured yet takes the mean of those
        that have been (else ``--prefill-tokens-per-s``): the instances behind one router
        run one model on like hardware, and a default far from what its peers measured
        drew requests to it (a measured 2,500 tokens/s against an assumed 5,000: its
        recompute looked twice as quick as it was)."""
        measured = [b.load.speed.value for b in self.backends if b.load.speed.samples]
        if not measured:
            return
        mean = sum(measured) / len(measured)
        for b in self.backends:
            if not b.load.speed.samples:
                b.load.speed.value = mean

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends)

    def __len__(self) -> int:
        return len(self.backends)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def candidates(self, model: str | None, exclude: Sequence[int] = ()) -> list[Backend]:
        """Healthy backends not in ``exclude`` that serve ``model`` (all healthy ones if none
        lists it: the backend then answers the unknown model itself)."""
        up = [b for b in self.backends if b.healthy and b.index not in exclude]
        serving = [b for b in up if b.serves(model)]
        return serving or up

    def set_health(self, backend: Backend, healthy: bool, reason: str) -> None:
        if backend.membership is not Membership.MEMBER:
            return  # left: what a check or a request learns of it now changes nothing
        if backend.healthy == healthy:
            backend.reason = reason
            return
        backend.healthy, backend.reason = healthy, reason
        if healthy:
            log.info("backend %s is up", backend.name)
        else:
            log.warning("backend %s is out: %s", backend.name, reason)
            backend.load.clear()
        for listener in self.listeners:
            listener(backend, healthy)
