"""``kvtier route``: the router as a command (SIGTERM / Ctrl-C: drain, then exit)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

from kvtier import logs
from kvtier.errors import ConfigError, KvtierError
from kvtier.router.config import DEFAULT_MAX_BODY_BYTES, NODE_TOKEN_ENV, CostModel, RouterConfig
from kvtier.router.sessions import SessionConfig

log = logging.getLogger("kvtier.router")
STRATEGY_NAMES = ("roundrobin", "session", "prefix", "cache")
_SESSION = SessionConfig()
"""The session options' defaults (the flags' defaults are its fields)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", allow_abbrev=False,
                       help="OpenAI-compatible router in front of vLLM instances "
                       "(cache-aware with kvtier node servers)")
    p.add_argument("--backends", metavar="URL,URL",
                   help="the instances' OpenAI-compatible base URLs (a fixed list; or find "
                   "them with --backends-dns / --backends-file)")
    p.add_argument("--kvtier-servers", metavar="URL,URL",
                   help="each backend's node-server HTTP API (its metrics_port), same order; "
                   "needed by the cache and prefix strategies")
    found = p.add_argument_group("finding the backends (docs/router.md)")
    found.add_argument("--backends-dns", metavar="http://NAME:PORT",
                       help="each address NAME resolves to (a Kubernetes headless Service) is "
                       "a backend at that PORT; re-resolved every --discovery-interval-s")
    found.add_argument("--backends-file", metavar="FILE",
                       help="the backends FILE lists (a URL a line, optionally its node "
                       "server's URL after it; or a YAML/JSON list); re-read every "
                       "--discovery-interval-s")
    found.add_argument("--kvtier-server-port", type=int, metavar="PORT",
                       help="a discovered backend's node server: http://ITS-ADDRESS:PORT")
    found.add_argument("--discovery-interval-s", type=float, default=5.0,
                       help="how often the name is resolved / the file read (default: "
                       "%(default)s)")
    found.add_argument("--discovery-timeout-s", type=float, default=2.0,
                       help="a resolution (or a file read) not done by then fails; the last "
                       "good set is kept (default: %(default)s)")
    found.add_argument("--max-backends", type=int, default=64,
                       help="at most this many discovered backends; the rest are left out "
                       "(default: %(default)s)")
    p.add_argument("--strategy", choices=STRATEGY_NAMES, default="roundrobin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key-env", metavar="VAR",
                      help="clients must send Authorization: Bearer $VAR")
    keys.add_argument("--api-key-file", metavar="FILE", help="... or the key in FILE")
    backend_keys = p.add_mutually_exclusive_group()
    backend_keys.add_argument("--backend-api-key-env", metavar="VAR",
                              help="the key sent to the backends (health checks included)")
    backend_keys.add_argument("--backend-api-key-file", metavar="FILE")
    p.add_argument("--tenants-file", metavar="FILE",
                   help="API keys to tenants (YAML or JSON; see docs/router.md): each tenant's "
                   "requests get its own cache salt, a priority cap, and tier details or not")
    salt = p.add_mutually_exclusive_group()
    salt.add_argument("--salt-secret-env", metavar="VAR",
                      help="with --tenants-file: the secret tenant salts are keyed with")
    salt.add_argument("--salt-secret-file", metavar="FILE", help="... or in an owner-only FILE")
    node_token = p.add_mutually_exclusive_group()
    node_token.add_argument("--node-token-env", metavar="VAR", default=NODE_TOKEN_ENV,
                            help="the node servers' HTTP API token, sent as Authorization: "
                            f"Bearer on lookups and namespace reads (default {NODE_TOKEN_ENV}; "
                            "unset or empty: none sent)")
    node_token.add_argument("--node-token-file", metavar="FILE",
                            help="... or the token in an owner-only FILE")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413 (default 8 MiB)")
    p.add_argument("--health-interval-s", type=float, default=2.0)
    p.add_argument("--no-backend-wait-s", type=float, default=5.0,
                   help="how long a request that finds no backend up waits for one, checking "
                        "those that are out at once (0: answer 503 at once)")
    p.add_argument("--session-header", default="X-Session-Id",
                   help="the session strategy's key (else the body's 'user')")
    ses = p.add_argument_group("sessions: retention the router sets (docs/router.md)")
    ses.add_argument("--session-retention", action="store_true",
                     help="keep live sessions' prefixes retained (a session: "
                     "--session-header, else the body's 'user', else its first messages)")
    ses.add_argument("--session-end-header", default=_SESSION.end_header,
                     help="a request with this header at 1/true ends its session "
                     "(default: %(default)s)")
    ses.add_argument("--max-sessions", type=int, default=_SESSION.max_sessions,
                     help="sessions held per tenant at most; its least recently seen leave first "
                     "(default: %(default)s)")
    ses.add_argument("--session-idle-s", type=float, default=_SESSION.idle_s,
                     help="a session without a request this long is over "
                     "(default: %(default)s)")
    ses.add_argument("--session-prefix-messages", type=int,
                     default=_SESSION.prefix_messages,
                     help="without a header or 'user', a chat is known by its first this "
                     "many messages (default: %(default)s)")
    ses.add_argument("--session-tool-priority", type=int, default=_SESSION.tool_priority,
                     help="after an answer that called a tool (default: %(default)s) ...")
    ses.add_argument("--session-tool-s", type=float, default=_SESSION.tool_s,
                     help="... for this long (default: %(default)s)")
    ses.add_argument("--session-turn-priority", type=int, default=_SESSION.turn_priority,
                     help="after an end of turn (default: %(default)s, the default "
                     "priority: nothing) ...")
    ses.add_argument("--session-turn-s", type=float, default=_SESSION.turn_s,
                     help="... for this long (default: %(default)s)")
    ses.add_argument("--session-tool-tokens", metavar="ID,ID", default="",
                     help="the token ids that start a tool call in the model's answers (e.g. "
                     "Qwen's <tool_call>): the connector then tells a tool call from an end of "
                     "turn when the answer ends; without them the router goes by the previous "
                     "answer")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--prefix-chunks", type=int, default=2,
                   help="the prefix strategy hashes this many leading chunks")
    p.add_argument("--prefill-tokens-per-s", type=float, default=5000.0,
                   help="cache strategy: a backend's prefill speed until measured")
    p.add_argument("--device-ttl-s", type=float, default=120.0,
                   help="cache strategy: how long a prefix sent to a backend counts as in its "
                   "device cache")
    p.add_argument("--lookup-timeout-s", type=float, default=0.1,
                   help="cache strategy: a node server slower than this holds nothing")
    p.add_argument("--lookup-memory-s", type=float, default=CostModel.lookup_memory_s,
                   help="cache strategy: how long a node server's lookup answer, with the "
                   "prompts sent to its backend since, stands for what it holds: only what "
                   "that cannot answer is asked (0: ask on every decision; default: "
                   "%(default)s; docs/router.md)")
    p.add_argument("--decode-weight", type=float, default=CostModel.decode_weight,
                   help="cache strategy: how much of a backend's measured crowding (how much "
                   "each stream decoding there slows the others' steps, from streamed "
                   "answers) counts in a newcomer's score there; 1: as measured, 0: only "
                   "prefill queues count (default: %(default)s; docs/router.md)")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a backend silent for this long fails the request")
    p.add_argument("--parts-file", metavar="FILE",
                   help="a stack.json (kvtier serve --instances): /metrics shows its parts' "
                   "states and restarts")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("kvtier route needs aiohttp; install with: pip install 'kvtier[route]'",
              file=sys.stderr)
        return 2
    try:
        config = RouterConfig.from_args(args)
    except ConfigError as exc:
        print(f"kvtier route: {exc}", file=sys.stderr)
        return 2
    logs.setup(args.log_level, "text")
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve(config))
    except KvtierError as exc:
        print(f"kvtier route: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvtier route: cannot listen on {config.host}:{config.port}: {exc}",
              file=sys.stderr)
        return 1
    return 0


async def serve(config: RouterConfig) -> None:
    from kvtier.router.app import Router

    router = Router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await router.start()
        await stop.wait()
        await router.drain()
    finally:
        await router.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):
                loop.remove_signal_handler(sig)
    log.info("kvtier route stopped")


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (vLLM brings it): a cheaper event loop for a proxy."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
