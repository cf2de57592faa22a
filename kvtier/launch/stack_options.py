"""``kvtier serve --instances N``'s options, parsed once into :class:`StackOptions`.

Ports follow ``--port P`` (default 8000): the router on P (vllm-router's Prometheus metrics on
P+100), instance i on P+1+i, instance i's node server (HTTP API, /metrics) on P+101+i, and
with vllm-router's ``kv_aware`` the relay of instance i's KV events on P+201+i
(:mod:`kvtier.launch.kv_events`). So N is at most 100 (instance 100 would take node server
0's port) and the highest of them at most 65535; :meth:`StackOptions.instance_ports` names
them for the check that they are free before anything starts.

With a node token (``$KVTIER_NODE_TOKEN``, or ``--node-token-file``) every node server asks
for it, and the router and ``kvtier verify`` are given it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.auth import read_secrets
from kvtier.config import AuthConfig, parse_size
from kvtier.errors import ConfigError
from kvtier.launch.front import (
    DEFAULT_POLICY,
    ROUTERS,
    check_router,
    check_router_args,
    router_metrics_port,
)
from kvtier.launch.plan import check_token_file
from kvtier.launch.shared_spec import shared_tier
from kvtier.launch.sizing import flag_value
from kvtier.launch.supervise import RestartPolicy
from kvtier.launch.vllm_router import ENV as VLLM_ROUTER_ENV
from kvtier.launch.vllm_router import INSTALL as INSTALL_VLLM_ROUTER
from kvtier.launch.vllm_router import find_vllm_router
from kvtier.ports import MAX_PORT

LOCAL_SERVICES = ("s3", "redis")
RESTART_MODES = ("on-failure", "never")
NODE_TOKEN_ENV = AuthConfig().http_token_env
MAX_INSTANCES = 100
_ONE_INSTANCE = {"server_config": "--server-config", "server_socket": "--server-socket",
                 "socket_path": "--socket-path", "kvtier_metrics_port": "--kvtier-metrics-port",
                 "log_file": "--log-file", "demo_request": "--demo-request",
                 "kvtier_metrics_host": "--kvtier-metrics-host",
                 "kvtier_advertise_host": "--kvtier-advertise-host",
                 "allow_remote_http_without_token": "--allow-remote-http-without-token"}


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the stack (--instances N)")
    g.add_argument("--instances", type=int, metavar="N",
                   help="start N vLLM instances, each with its own node server, one shared "
                   "tier and a router in front (see docs/serve-stack.md)")
    g.add_argument("--router", choices=ROUTERS, default="kvtier",
                   help="the router in front (default: %(default)s)")
    g.add_argument("--router-policy", metavar="NAME",
                   help="its strategy / policy (default: cache for kvtier, round_robin for "
                   "vllm-router)")
    g.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the router's command line, e.g. "
                   "--router-arg=--decode-weight=0 (repeat it for more; not the flags the "
                   "stack sets itself)")
    g.add_argument("--vllm-router", metavar="PATH",
                   help="the vllm-router executable for --router vllm-router (default: "
                   f"${VLLM_ROUTER_ENV}, then the one `{INSTALL_VLLM_ROUTER}` installs, then "
                   "PATH); kvtier serve never installs it")
    g.add_argument("--shared", metavar="SPEC",
                   help="the shared tier: a folder (default ~/.cache/kvtier/shared), "
                   "s3://BUCKET/PREFIX?endpoint=URL, redis://HOST:PORT/DB, or none")
    g.add_argument("--shared-local", choices=LOCAL_SERVICES,
                   help="start a local SeaweedFS (s3) or redis-server for the shared tier")
    g.add_argument("--shared-size", default="8GiB",
                   help="the shared tier's capacity (default: %(default)s)")
    g.add_argument("--run-dir", metavar="DIR",
                   help="logs, configs and stack.json (default: ~/.cache/kvtier/stack)")
    g.add_argument("--restart", choices=RESTART_MODES, default="on-failure",
                   help="on-failure (default): a part that exits or stops answering is "
                   "restarted alone, with backoff; never: the stack stops when one does")
    g.add_argument("--restart-limit", type=int, default=5, metavar="N",
                   help="restarts of one part within --restart-window before the stack gives "
                   "up on it (default: %(default)s)")
    g.add_argument("--restart-window", default="600", metavar="SECONDS",
                   help="the window of --restart-limit (default: %(default)s)")
    g.add_argument("--verify", action="store_true",
                   help="once up, run `kvtier verify` against the stack, then stop; the exit "
                   "status is verify's")


@dataclass(frozen=True)
class StackOptions:
    instances: int
    router: str
    policy: str
    host: str
    port: int
    shared_spec: str | None
    """``--shared`` as given (None: the default folder); resolved by :meth:`shared_tier`."""
    shared_local: str | None
    shared_bytes: int
    arena_bytes: int
    model: str | None
    vllm_args: tuple[str, ...]
    """Options for every instance's vLLM (``--port`` and ``--host`` taken out)."""
    chunk_tokens: int
    priority: int
    run_dir: Path
    verify: bool
    node_token_file: str | None = None
    """``--node-token-file`` (absolute, checked); None: ``$KVTIER_NODE_TOKEN`` if set."""
    vllm_router: Path | None = None
    """The vllm-router executable (found before anything starts); None for other routers."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    router_args: tuple[str, ...] = ()
    """``--router-arg``: appended to the router's command line (checked)."""

    @property
    def kv_events(self) -> bool:
        """Whether the instances publish KV events for the router: vllm-router's
        ``kv_aware`` routes on nothing else."""
        return self.router == "vllm-router" and self.policy == "kv_aware"

    @classmethod
    def from_args(cls, args: argparse.Namespace, default_arena: int) -> StackOptions:
        n = int(args.instances)
        if n < 1:
            raise ConfigError("--instances must be at least 1")
        if n > MAX_INSTANCES:
            raise ConfigError(f"--instances: at most {MAX_INSTANCES}, got {n} (instance i "
                              "listens on --port + 1 + i, its node server on --port + 101 + i)")
        for attr, flag in _ONE_INSTANCE.items():
            if getattr(args, attr, None):
                raise ConfigError(f"{flag} is for one instance; with --instances each "
                                  "instance gets its own server, socket, port and log")
        if args.shared_local and args.shared:
            raise ConfigError("give --shared or --shared-local, not both")
        policy = args.router_policy or DEFAULT_POLICY[args.router]
        check_router(args.router, policy)
        router_args = tuple(args.router_arg)
        check_router_args(args.router, policy, router_args)
        vllm_router = _vllm_router(args)
        vllm_args = list(args.vllm_args)
        port = int(flag_value(vllm_args, "--port") or 8000)
        host = flag_value(vllm_args, "--host") or "127.0.0.1"
        arena = (parse_size(args.arena_size, "--arena-size") if args.arena_size
                 else max(default_arena // n, 256 << 20))
        options = cls(
            instances=n, router=args.router, policy=policy, host=host, port=port,
            shared_spec=args.shared, shared_local=args.shared_local,
            shared_bytes=parse_size(args.shared_size, "--shared-size"), arena_bytes=arena,
            model=args.model, vllm_args=tuple(_without(vllm_args, "--port", "--host")),
            chunk_tokens=args.chunk_tokens, priority=args.priority,
            run_dir=Path(args.run_dir).expanduser() if args.run_dir else _default_run_dir(),
            verify=bool(args.verify), node_token_file=_token_file(args),
            vllm_router=vllm_router, restart=_restart_policy(args), router_args=router_args)
        top, what = options.node_port(n - 1), "node server"
        if options.kv_events:
            top, what = options.kv_event_port(n - 1), "KV-event relay"
            if flag_value(vllm_args, "--kv-events-config") is not None:
                raise ConfigError("--kv-events-config: kvtier serve sets each instance's KV "
                                  "events for --router-policy kv_aware (an ipc path per "
                                  "instance, relayed on 127.0.0.1); leave it out")
        if top > MAX_PORT:
            raise ConfigError(f"--port {port}: instance {n - 1}'s {what} would listen on "
                              f"{top}, above {MAX_PORT}; choose a --port of at most "
                              f"{MAX_PORT - (top - port)}")
        if options.shared_local is None:
            options.shared_tier()  # a bad --shared fails before anything starts
        else:
            from kvtier.launch.local_shared import check_local_shared

            check_local_shared(options.shared_local)
        return options

    def shared_tier(self, spec: str | None = None) -> dict[str, Any] | None:
        return shared_tier(spec if spec is not None else self.shared_spec, self.shared_bytes)

    def node_token_source(self) -> dict[str, str] | None:
        """Where the node servers' token comes from (for stack.json; never the token)."""
        if self.node_token_file:
            return {"file": self.node_token_file}
        return {"env": NODE_TOKEN_ENV} if os.environ.get(NODE_TOKEN_ENV) else None

    def node_token(self) -> str | None:
        """The token the node servers will ask for (the first entry), None without one."""
        found = read_secrets(None if self.node_token_file else NODE_TOKEN_ENV,
                             self.node_token_file, what="node HTTP token")
        return found[0].decode() if found else None

    def instance_port(self, i: int) -> int:
        return self.port + 1 + i

    def node_port(self, i: int) -> int:
        return self.port + 101 + i

    def kv_event_port(self, i: int) -> int:
        return self.port + 201 + i

    def instance_ports(self) -> dict[str, int]:
        """The ports the instances, their node servers, vllm-router's metrics and (with
        ``kv_aware``) the relays of their KV events listen on (127.0.0.1), by what listens
        there."""
        out = {}
        if self.router == "vllm-router":
            out["vllm-router's metrics"] = router_metrics_port(self.port)
        for i in range(self.instances):
            out[f"instance {i}"] = self.instance_port(i)
            out[f"instance {i}'s node server"] = self.node_port(i)
            if self.kv_events:
                out[f"instance {i}'s KV-event relay"] = self.kv_event_port(i)
        return out


def _restart_policy(args: argparse.Namespace) -> RestartPolicy:
    mode = getattr(args, "restart", "on-failure")
    if mode not in RESTART_MODES:
        raise ConfigError(f"--restart: expected one of {', '.join(RESTART_MODES)}, got {mode!r}")
    limit = int(getattr(args, "restart_limit", 5))
    if limit < 0:
        raise ConfigError(f"--restart-limit: expected 0 or more, got {limit}")
    raw = str(getattr(args, "restart_window", "600"))
    try:
        window = float(raw.removesuffix("s"))
    except ValueError:
        raise ConfigError(f"--restart-window: expected seconds, got {raw!r}") from None
    if window <= 0:
        raise ConfigError(f"--restart-window: expected more than 0 s, got {raw!r}")
    return RestartPolicy(restart_on_failure=mode == "on-failure", limit=limit, window_s=window)


def _vllm_router(args: argparse.Namespace) -> Path | None:
    """The vllm-router to run for ``--router vllm-router``, found now, not when the router
    starts (after the engines): a missing one fails before anything starts."""
    given = getattr(args, "vllm_router", None)
    if args.router != "vllm-router":
        if given:
            raise ConfigError(f"--vllm-router is for --router vllm-router, not --router "
                              f"{args.router}")
        return None
    return find_vllm_router(given)


def _token_file(args: argparse.Namespace) -> str | None:
    path = getattr(args, "node_token_file", None)
    return check_token_file(path) if path else None


def _without(argv: list[str], *flags: str) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        if any(arg.startswith(f + "=") for f in flags):
            continue
        out.append(arg)
    return out


def _default_run_dir() -> Path:
    from kvtier.demo.model import default_cache_dir

    return default_cache_dir() / "stack"

