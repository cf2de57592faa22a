"""The backends behind the router: where they are, whether they are up, what they serve.

A :class:`Backend` owns what the health monitor learns about it (up or down, its models, its
queue and device cache size from vLLM's /metrics, the namespaces its node server lists) and
its :class:`~kvtier.router.load.BackendLoad`. The pool hands strategies the healthy
candidates for a model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.router.config import RouterConfig
from kvtier.router.keys import NamespaceInfo, pick_namespace
from kvtier.router.load import BackendLoad, StepModel
from kvtier.router.redact import redact_url

log = logging.getLogger("kvtier.router")


@dataclass
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
        self.backends = [
            Backend(i, url, node, BackendLoad(cost.prefill_tokens_per_s, cost.speed_alpha,
                                              self.steps))
            for i, (url, node) in enumerate(zip(config.backends, config.kvtier_servers,
                                                strict=True))]
        self.listeners: list[Any] = []
        """Called with (backend, healthy) on every change (metrics, device history)."""

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
