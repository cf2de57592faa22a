"""``kvtier verify --url URL [--kvtier-servers URL,URL] [--backends URL,URL]``, or
``kvtier verify --stack stack.json`` for a stack ``kvtier serve --instances N`` runs.

The node servers' HTTP APIs may ask for a bearer token: ``--node-token-env VAR`` (default
``$KVTIER_NODE_TOKEN``) or ``--node-token-file FILE`` (with ``--stack``, the file the stack was
started with); it is sent only to the node servers, never printed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.auth import read_secrets
from kvtier.config import AuthConfig
from kvtier.errors import ConfigError
from kvtier.router.config import read_key
from kvtier.verify.run import VerifyOptions, api_key_from_env, verify

NODE_TOKEN_ENV = AuthConfig().http_token_env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a tiered stack through its entry point (the seed's five steps)",
        description="Send a long-prefix request through URL, check that its chunks reach the "
        "shared tier, that a similar request is served from cache and faster, and that "
        "another instance serves it from the shared tier. Exit status 0 only if all pass.")
    p.add_argument("--url", help="the OpenAI-compatible entry point (router or instance)")
    p.add_argument("--stack", metavar="FILE", help="stack.json of `kvtier serve --instances "
                   "N` (gives --url, --kvtier-servers, --backends, --shared-path)")
    p.add_argument("--kvtier-servers", metavar="URL,URL", default="",
                   help="the instances' node-server HTTP APIs (metrics_port)")
    p.add_argument("--backends", metavar="URL,URL", default="",
                   help="the instances' own URLs, in the same order (tells who served)")
    p.add_argument("--shared-path", metavar="DIR", help="an fs shared tier's folder: count "
                   "its chunk files")
    p.add_argument("--model", help="model name (default: the first the entry point lists)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the "
                      "bearer key (default: $OPENAI_API_KEY, else $VLLM_API_KEY)")
    keys.add_argument("--api-key-file", metavar="FILE", help="... or the key in FILE")
    keys.add_argument("--api-key", help=argparse.SUPPRESS)  # deprecated: visible in ps
    tokens = p.add_mutually_exclusive_group()
    tokens.add_argument("--node-token-env", metavar="VAR",
                        help=f"environment variable holding the node servers' HTTP token "
                        f"(default: ${NODE_TOKEN_ENV})")
    tokens.add_argument("--node-token-file", metavar="FILE",
                        help="... or the token in FILE (mode 600; default with --stack: the "
                        "stack's --node-token-file)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions")
    p.add_argument("--prefix-chars", type=int, default=12000,
                   help="length of the long prefix in characters (default: %(default)s)")
    p.add_argument("--attempts", type=int, default=4,
                   help="requests sent to reach another instance (default: %(default)s)")
    p.set_defaults(func=run)


def _api_key(args: argparse.Namespace) -> str | None:
    """From --api-key-file or --api-key-env, else $OPENAI_API_KEY / $VLLM_API_KEY; a key on
    the command line still works, with a warning (any user can read it in ps)."""
    if args.api_key:
        print("kvtier verify: --api-key is deprecated (other users can read it with ps); "
              "use --api-key-env VAR or --api-key-file FILE", file=sys.stderr)
        return str(args.api_key)
    return read_key(args.api_key_env, args.api_key_file, "--api-key") or api_key_from_env()


def node_token(args: argparse.Namespace, state: dict[str, Any] | None = None) -> str | None:
    """The node servers' bearer token: from --node-token-file, --node-token-env, the file
    the stack was started with, else $KVTIER_NODE_TOKEN (the first entry; None if unset)."""
    file = args.node_token_file
    if file is None and args.node_token_env is None and state:
        file = (state.get("node_token") or {}).get("file")
    env = args.node_token_env or NODE_TOKEN_ENV
    found = read_secrets(None if file else env, file, what="node HTTP token")
    return found[0].decode() if found else None


def run(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        "api_key": _api_key(args), "api": args.api,
        "prefix_chars": args.prefix_chars, "attempts": args.attempts, "model": args.model}
    if args.url:
        overrides["url"] = args.url.rstrip("/")
    for name in ("kvtier_servers", "backends"):
        value = getattr(args, name)
        if value:
            overrides[name] = tuple(u.strip().rstrip("/") for u in value.split(",") if u)
    if args.shared_path:
        overrides["shared_path"] = Path(args.shared_path).expanduser()
    state: dict[str, Any] | None = None
    if args.stack:
        try:
            state = json.loads(Path(args.stack).expanduser().read_text())
        except (OSError, ValueError) as exc:
            print(f"kvtier verify: cannot read {args.stack}: {exc}", file=sys.stderr)
            return 2
        if not isinstance(state, dict):
            print(f"kvtier verify: {args.stack}: not a stack.json (a JSON object)",
                  file=sys.stderr)
            return 2
    try:
        overrides["node_token"] = node_token(args, state)
    except ConfigError as exc:
        print(f"kvtier verify: {exc}", file=sys.stderr)
        return 2
    if state is not None:
        options = VerifyOptions.from_stack(state, **overrides)
    elif "url" in overrides:
        _discover(overrides)
        options = VerifyOptions(**overrides)
    else:
        print("kvtier verify: give --url or --stack", file=sys.stderr)
        return 2
    return verify(options)


def _discover(overrides: dict[str, Any]) -> None:
    """Without --kvtier-servers and --backends, ask the entry point who is behind it (a
    ``kvtier route`` answers ``/kvtier/backends``)."""
    if overrides.get("kvtier_servers") or overrides.get("backends"):
        return
    from kvtier.verify.discover import discover

    key = overrides.get("api_key")
    found = discover(overrides["url"], {"Authorization": f"Bearer {key}"} if key else None)
    if found is None:
        return
    print(f"kvtier verify: the router lists {len(found.backends)} instance(s)"
          + (" and their node servers" if found.kvtier_servers else ""))
    overrides["backends"] = found.backends
    if found.kvtier_servers:
        overrides["kvtier_servers"] = found.kvtier_servers
