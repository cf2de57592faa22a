"""``kvtier`` command line: serve | server | route | verify | bench | trace | plan | ls | gc | rm.

Each subcommand lives with its package and exposes ``register(subparsers)``; modules whose
optional dependencies are missing (vLLM for ``serve`` and ``bench ttft``) are reported when
used, not when the CLI starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtier.errors import KvtierError
from kvtier.version import __version__

_PLUGINS = {
    "serve": "kvtier.launch.serve",
    "trace": "kvtier.trace.cli",
    "plan": "kvtier.plan.cli",
    "admin": "kvtier.admin",
    "verify": "kvtier.verify.cli",
    "route": "kvtier.router.cli",
}
_BENCH_PLUGINS = {
    "gpu": "kvtier.bench.gpu",
    "micro": "kvtier.bench.micro",
    "ttft": "kvtier.bench.ttft",
    "multiround": "kvtier.bench.multiround",
    "agents": "kvtier.bench.agents",
    "compare": "kvtier.bench.compare",
    "sweep": "kvtier.bench.sweep",
    "shared": "kvtier.bench.shared",
    "route": "kvtier.bench.route",
    "peers": "kvtier.bench.peers",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_server(sub)
    bench = sub.add_parser("bench", help="benchmarks that print figures against a baseline")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, module in _BENCH_PLUGINS.items():
        _register(bench_sub, name, module)
    for name, module in _PLUGINS.items():
        _register(sub, name, module)
    return parser


def has_command(name: str) -> bool:
    """Whether this kvtier has the subcommand ``name`` (and its module imports)."""
    module = _PLUGINS.get(name)
    if module is None:
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _register(sub: argparse._SubParsersAction, name: str, module: str) -> None:
    try:
        importlib.import_module(module).register(sub)
    except ImportError as exc:
        missing = sub.add_parser(name, help=f"(unavailable: {exc})")
        missing.set_defaults(func=lambda _args, e=exc: _unavailable(name, e))


def _unavailable(name: str, exc: ImportError) -> int:
    print(f"kvtier {name}: unavailable here ({exc}); install with: pip install 'kvtier[vllm]'",
          file=sys.stderr)
    return 2


def _add_server(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run the node cache server")
    p.add_argument("--config", required=True, help="YAML server config (see docs/server.md)")
    p.add_argument("--socket", help="override socket_path from the config")
    p.set_defaults(func=_run_server)


def _run_server(args: argparse.Namespace) -> int:
    import msgspec

    from kvtier import logs
    from kvtier.config import ServerConfig
    from kvtier.processes import StopRequest
    from kvtier.server import NodeServer

    config = ServerConfig.from_yaml(args.config)
    if args.socket:
        config = msgspec.structs.replace(config, socket_path=args.socket)
    logs.setup(config.log_level, config.log_format)
    server = NodeServer(config)
    with StopRequest() as stop:  # a handler that only sets a flag: never deadlocks
        server.start()
        while not stop.sleep(0.5):
            pass
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
