"""The router in front of ``kvtier serve --instances N``: one OpenAI endpoint for all.

=============  ==============================================================================
``--router``   command
=============  ==============================================================================
``kvtier``     ``kvtier route --backends URL,URL --kvtier-servers URL,URL --strategy S
               --port P`` (``--router-policy``: the strategy, default ``cache``)
``vllm-router``  vLLM's Rust router from its own venv (:func:`kvtier.bench.peers.
               ensure_vllm_router`, installed on first use): ``vllm-router --worker-urls URL
               URL --policy P --port P`` (default policy ``round_robin``)
``none``       no router: clients call the instances directly
=============  ==============================================================================
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import ConfigError

ROUTERS = ("kvtier", "vllm-router", "none")
DEFAULT_POLICY = {"kvtier": "cache", "vllm-router": "round_robin", "none": ""}
VLLM_ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                        "consistent_hash", "sticky_least_loaded")


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


def router_argv(kind: str, policy: str, host: str, port: int, backends: Sequence[str],
                node_urls: Sequence[str], install_log: Path, *,
                node_token_file: str | None = None) -> list[str] | None:
    """The router's command line (None for ``none``); installs vllm-router if needed.
    ``kvtier route`` reads the node token from ``$KVTIER_NODE_TOKEN`` (inherited) unless
    ``node_token_file`` is given; vllm-router never asks node servers."""
    if kind == "none":
        return None
    if kind == "kvtier":
        argv = [sys.executable, "-m", "kvtier", "route", "--backends", ",".join(backends),
                "--kvtier-servers", ",".join(node_urls), "--strategy", policy,
                "--host", host, "--port", str(port)]
        return argv + (["--node-token-file", node_token_file] if node_token_file else [])
    from kvtier.bench.peers import ensure_vllm_router

    binary = ensure_vllm_router(log_file=install_log)
    return [str(binary), "--host", host, "--port", str(port), "--worker-urls", *backends,
            "--policy", policy, "--log-level", "warning"]
