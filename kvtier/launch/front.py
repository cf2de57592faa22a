"""The router in front of ``kvtier serve --instances N``: one OpenAI endpoint for all.

=============  ==============================================================================
``--router``   command
=============  ==============================================================================
``kvtier``     ``kvtier route --backends URL,URL --kvtier-servers URL,URL --strategy S
               --port P`` (``--router-policy``: the strategy, default ``cache``)
``vllm-router``  vLLM's Rust router, found (never installed) by :mod:`kvtier.launch.
               vllm_router`: ``vllm-router --worker-urls URL URL --policy P --port P``
               (default policy ``round_robin``), health-checking its workers every 2 s
               (:data:`VLLM_ROUTER_HEALTH`), its Prometheus metrics on 127.0.0.1:P+100
               (:func:`router_metrics_port`); ``kv_aware`` adds ``--kv-event-source URL=
               tcp://127.0.0.1:PORT`` per instance (:class:`KvEventSources`)
``none``       no router: clients call the instances directly
=============  ==============================================================================
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.launch.vllm_router import find_vllm_router

ROUTERS = ("kvtier", "vllm-router", "none")
DEFAULT_POLICY = {"kvtier": "cache", "vllm-router": "round_robin", "none": ""}
VLLM_ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                        "consistent_hash", "sticky_least_loaded")


VLLM_ROUTER_HEALTH = ("--health-check-interval-secs", "2", "--health-check-timeout-secs", "2",
                      "--health-failure-threshold", "1", "--health-success-threshold", "1")
"""A worker out on its first failed health check and back on its first good one, every 2 s
(vllm-router's defaults: every 60 s, 3 failures to take one out): the stack restarts dead
instances, and the router must route around them meanwhile."""


@dataclass(frozen=True)
class KvEventSources:
    """Where vllm-router's ``kv_aware`` reads each instance's KV events
    (:mod:`kvtier.launch.kv_events`), and what it needs to read them: the engines' block size
    (the events' block hashes cover that many tokens) and the served model's name."""

    endpoints: tuple[str, ...]
    """``tcp://127.0.0.1:PORT`` per instance, in the order of the backends."""
    block_size: int
    model: str

    def argv(self, backends: Sequence[str]) -> list[str]:
        if len(backends) != len(self.endpoints):
            raise ValueError(f"{len(self.endpoints)} KV-event sources for {len(backends)} "
                             "backends")
        out: list[str] = []
        for url, endpoint in zip(backends, self.endpoints, strict=True):
            out += ["--kv-event-source", f"{url}={endpoint}"]
        return [*out, "--kv-event-block-size", str(self.block_size),
                "--kv-event-model", self.model]


def router_metrics_port(port: int) -> int:
    """Where vllm-router serves its Prometheus metrics when it routes on ``port``: always
    given, because its default (29000, on every interface) is a fixed port that anything
    else may hold (a SeaweedFS the stack started on free ports took it once), and then
    vllm-router exits at every start."""
    return port + 100


def check_router(kind: str, policy: str) -> None:
    """Fail early (before any engine starts) on a router this kvtier cannot start."""
    if kind not in ROUTERS:
        raise ConfigError(f"--router: expected one of {', '.join(ROUTERS)}, got {kind!r}")
    if kind == "kvtier":
        from kvtier.cli import has_command

        if not has_command("route"):
            raise ConfigError("--router kvtier: this kvtier has no `kvtier route` yet; use "
                              "--router vllm-router or --router none")
    if kind == "vllm-router" and policy not in VLLM_ROUTER_POLICIES:
        raise ConfigError(f"--router-policy: vllm-router knows "
                          f"{', '.join(VLLM_ROUTER_POLICIES)}; got {policy!r}")


STACK_ROUTER_FLAGS = frozenset({
    "--host", "--port", "--backends", "--kvtier-servers", "--strategy", "--parts-file",
    "--node-token-file", "--worker-urls", "--policy", "--prometheus-host",
    "--prometheus-port", "--kv-event-source", "--kv-event-block-size", "--kv-event-model"})
"""Router flags the stack sets itself: ``--router-arg`` may not give them."""


def check_router_args(kind: str, policy: str, extra: Sequence[str]) -> None:
    """Fail early on ``--router-arg`` values the stack sets itself, on any with ``--router
    none``, and (for ``kvtier route``, whose parser is here) on any it would refuse."""
    if not extra:
        return
    if kind == "none":
        raise ConfigError("--router-arg: there is no router with --router none")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in STACK_ROUTER_FLAGS:
            raise ConfigError(f"--router-arg {arg}: the stack sets {flag} itself; give the "
                              "stack's own options (--port, --router-policy, ...) instead")
    if kind == "kvtier":
        from kvtier.cli import build_parser
        from kvtier.router.config import RouterConfig

        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = build_parser().parse_args(
                    ["route", "--backends", "http://127.0.0.1:1", "--strategy", policy,
                     *extra])
        except SystemExit:
            said = errors.getvalue().strip().splitlines()
            raise ConfigError(f"--router-arg: kvtier route refuses {' '.join(extra)!r}: "
                              f"{said[-1] if said else 'bad arguments'}") from None
        RouterConfig.from_args(args)  # its values (a weight out of range, ...)


def router_argv(kind: str, policy: str, host: str, port: int, backends: Sequence[str],
                node_urls: Sequence[str], vllm_router: Path | None = None, *,
                node_token_file: str | None = None,
                parts_file: Path | None = None,
                kv_events: KvEventSources | None = None,
                extra: Sequence[str] = ()) -> list[str] | None:
    """The router's command line (None for ``none``). ``vllm_router``: the executable for
    ``vllm-router`` (ignored by the others; None: :func:`find_vllm_router`'s, which fails
    when there is none). ``kvtier route`` reads the node token from ``$KVTIER_NODE_TOKEN``
    (inherited) unless ``node_token_file`` is given; vllm-router never asks node servers.
    ``parts_file``: the stack.json whose parts' states ``kvtier route`` shows in its
    /metrics. ``kv_events``: the instances' KV-event streams, for vllm-router's
    ``kv_aware``. ``extra``: more arguments, last (``--router-arg``, checked by
    :func:`check_router_args`)."""
    if kind == "none":
        return None
    if kind == "kvtier":
        argv = [sys.executable, "-m", "kvtier", "route", "--backends", ",".join(backends),
                *(["--kvtier-servers", ",".join(node_urls)] if node_urls else []),
                "--strategy", policy, "--host", host, "--port", str(port)]
        if parts_file is not None:
            argv += ["--parts-file", str(parts_file)]
        return argv + (["--node-token-file", node_token_file] if node_token_file else []) \
            + list(extra)
    binary = vllm_router or find_vllm_router()
    argv = [str(binary), "--host", host, "--port", str(port), "--worker-urls", *backends,
            "--policy", policy, "--log-level", "warning", *VLLM_ROUTER_HEALTH,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(router_metrics_port(port))]
    if policy == "kv_aware":
        if kv_events is None:
            raise ConfigError("vllm-router's kv_aware needs the instances' KV-event sources")
        argv += kv_events.argv(backends)
    return argv + list(extra)
