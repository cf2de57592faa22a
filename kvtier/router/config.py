"""The router's configuration, parsed once from the command line into frozen dataclasses."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvtier.auth import read_secrets
from kvtier.errors import ConfigError
from kvtier.router.redact import redact_url, userinfo
from kvtier.router.sessions import SessionConfig
from kvtier.router.sources import DnsName
from kvtier.router.tenants import Tenants, load_tenants

DEFAULT_MAX_BODY_BYTES = 8 << 20
NODE_TOKEN_ENV = "KVTIER_NODE_TOKEN"


@dataclass(frozen=True)
class CostModel:
    """Knobs of the ``cache`` strategy's TTFT estimate (see docs/router.md)."""

    prefill_tokens_per_s: float = 5000.0
    """A backend's prefill speed until it has been measured from its responses."""
    speed_alpha: float = 0.3
    """Weight of a new speed sample in the moving average."""
    min_sample_tokens: int = 256
    """Recomputed tokens a response needs before it counts as a speed sample."""
    device_ttl_s: float = 120.0
    """How long the router assumes a prefix it sent to a backend stays in vLLM's own cache."""
    device_tokens: int = 65536
    """vLLM's device cache size in tokens when the backend's /metrics does not say."""
    lookup_timeout_s: float = 0.1
    """A node server that has not answered a lookup by then counts as holding nothing."""
    lookup_memory_s: float = 30.0
    """How long a node server's lookup answer, with what the router sent since, stands for
    what it holds: a decision asks only about what that memory cannot answer
    (:mod:`kvtier.router.holdings`; 0: every decision asks)."""
    decode_weight: float = 1.0
    """How much of a backend's measured crowding counts in a newcomer's score there: what
    the streams decoding beside it cost it, and it them (:meth:`BackendLoad.crowding_s`;
    1, the default: as measured; 0: only prefill queues count; docs/router.md)."""


@dataclass(frozen=True)
class DiscoveryConfig:
    """Where the backends are found when they are not a fixed list (docs/router.md)."""

    dns: DnsName | None = None
    """``--backends-dns``: each address of the name is a backend."""
    file: Path | None = None
    """``--backends-file``: the backends it lists."""
    node_port: int | None = None
    """``--kvtier-server-port``: each backend's node server, at the backend's address."""
    interval_s: float = 5.0
    timeout_s: float = 2.0
    """A DNS resolution or a file read not done by then fails (the last good set is kept)."""
    max_backends: int = 64

    def __post_init__(self) -> None:
        if (self.dns is None) == (self.file is None):
            raise ConfigError("discovery: give --backends-dns or --backends-file (one)")


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    kvtier_servers: tuple[str | None, ...]
    """Each backend's node-server HTTP API (same order), or None. Both empty with
    ``discovery``: the backends are found at run time."""
    strategy: str = "roundrobin"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    backend_api_key: str | None = None
    health_interval_s: float = 2.0
    no_backend_wait_s: float = 5.0
    """A request that finds no backend up waits this long (checking the backends that are
    out at once, then every 0.25 s) for one to come back before it is answered 503: an
    instance that just restarted is let in without waiting for the next health round."""
    session_header: str = "X-Session-Id"
    drain_s: float = 30.0
    prefix_chunks: int = 2
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    """A backend that sends nothing for this long fails the request."""
    cost: CostModel = CostModel()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """A request body larger than this is refused with 413, before it is read whole."""
    tenants: Tenants | None = None
    """From ``--tenants-file``; None: one open tenant (``api_key``, if set, is its key)."""
    node_token: str | None = None
    """Sent as ``Authorization: Bearer`` on every call to a node server's HTTP API."""
    parts_file: str | None = None
    """A stack.json whose parts' states /metrics shows (``kvtier serve --instances``)."""
    discovery: DiscoveryConfig | None = None
    sessions: SessionConfig = field(default_factory=SessionConfig)

    def __post_init__(self) -> None:
        if self.discovery is not None and self.backends:
            raise ConfigError("--backends and --backends-dns / --backends-file: give one "
                              "source of backends")
        if self.backend_api_key and any(userinfo(u) for u in self.backends):
            raise ConfigError("--backend-api-key-*: a backend URL carries credentials "
                              "(user:password@) too; give one or the other")
        if self.node_token and any(userinfo(u) for u in self.kvtier_servers if u):
            raise ConfigError("--node-token-*: a --kvtier-servers URL carries credentials "
                              "(user:password@) too; give one or the other")

    def __repr__(self) -> str:  # never show keys or URL credentials, even in a traceback
        return (f"RouterConfig(backends={tuple(redact_url(u) for u in self.backends)}, "
                f"strategy={self.strategy!r}, "
                f"api_key={'set' if self.api_key else None}, "
                f"backend_api_key={'set' if self.backend_api_key else None}, "
                f"tenants={self.tenants!r}, node_token={'set' if self.node_token else None})")

    __str__ = __repr__

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        discovery = _discovery(args)
        backends = parse_urls(args.backends or "", "--backends")
        if discovery is None and not backends:
            raise ConfigError("--backends: give at least one URL (or find them with "
                              "--backends-dns / --backends-file)")
        servers: tuple[str | None, ...] = (None,) * len(backends)
        if args.kvtier_servers and discovery is not None:
            raise ConfigError("--kvtier-servers is for --backends; discovered backends' "
                              "node servers are at --kvtier-server-port on their address")
        if args.kvtier_servers:
            given = parse_urls(args.kvtier_servers, "--kvtier-servers")
            if len(given) != len(backends):
                raise ConfigError(f"--kvtier-servers: {len(given)} URLs for {len(backends)} "
                                  "backends; give one per backend, in the same order")
            servers = given
        cost = CostModel(
            prefill_tokens_per_s=_positive(args.prefill_tokens_per_s, "--prefill-tokens-per-s"),
            device_ttl_s=_positive(args.device_ttl_s, "--device-ttl-s"),
            lookup_timeout_s=_positive(args.lookup_timeout_s, "--lookup-timeout-s"),
            lookup_memory_s=_non_negative(args.lookup_memory_s, "--lookup-memory-s"),
            decode_weight=_weight(args.decode_weight, "--decode-weight"))
        api_key = read_key(args.api_key_env, args.api_key_file, "--api-key")
        return cls(
            backends=backends, kvtier_servers=servers, strategy=args.strategy,
            host=args.host, port=_port(args.port),
            api_key=api_key,
            backend_api_key=read_key(args.backend_api_key_env, args.backend_api_key_file,
                                     "--backend-api-key"),
            health_interval_s=_positive(args.health_interval_s, "--health-interval-s"),
            no_backend_wait_s=_non_negative(args.no_backend_wait_s, "--no-backend-wait-s"),
            session_header=args.session_header, drain_s=_non_negative(args.drain_s, "--drain-s"),
            prefix_chunks=int(_positive(args.prefix_chunks, "--prefix-chunks")),
            request_timeout_s=_positive(args.request_timeout_s, "--request-timeout-s"),
            cost=cost,
            max_body_bytes=int(_positive(args.max_body_bytes, "--max-body-bytes")),
            tenants=_tenants(args, api_key),
            node_token=_first_secret(args.node_token_env, args.node_token_file, "node token"),
            parts_file=getattr(args, "parts_file", None), discovery=discovery,
            sessions=_sessions(args))


def _sessions(args: argparse.Namespace) -> SessionConfig:
    if not getattr(args, "session_retention", False):
        if getattr(args, "session_tool_tokens", ""):
            raise ConfigError("--session-tool-tokens needs --session-retention: without it the "
                              "router sets no retention for sessions")
        return SessionConfig()
    return SessionConfig(
        retain=True, end_header=args.session_end_header, max_sessions=args.max_sessions,
        idle_s=args.session_idle_s, prefix_messages=args.session_prefix_messages,
        tool_priority=args.session_tool_priority, tool_s=args.session_tool_s,
        turn_priority=args.session_turn_priority, turn_s=args.session_turn_s,
        tool_tokens=token_ids(args.session_tool_tokens, "--session-tool-tokens"))


def token_ids(text: str, option: str) -> tuple[int, ...]:
    """``ID,ID`` as token ids; ConfigError naming ``option`` otherwise."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{option}: expected token ids separated by commas, as in "
                          f"151657,151658, got {text!r}") from None


MAX_BACKENDS = 1024
"""The highest --max-backends accepted."""


def _discovery(args: argparse.Namespace) -> DiscoveryConfig | None:
    dns, file = getattr(args, "backends_dns", None), getattr(args, "backends_file", None)
    node_port = getattr(args, "kvtier_server_port", None)
    if dns is None and file is None:
        if node_port is not None:
            raise ConfigError("--kvtier-server-port is for discovered backends "
                              "(--backends-dns / --backends-file); with --backends give "
                              "--kvtier-servers")
        return None
    if args.backends:
        raise ConfigError("--backends and --backends-dns / --backends-file: give one "
                          "source of backends")
    if dns is not None and file is not None:
        raise ConfigError("--backends-dns and --backends-file: give one of them")
    if node_port is not None and not 1 <= node_port <= 65535:
        raise ConfigError(f"--kvtier-server-port: must be in [1, 65535], got {node_port}")
    most = int(args.max_backends)
    if not 1 <= most <= MAX_BACKENDS:
        raise ConfigError(f"--max-backends: must be in [1, {MAX_BACKENDS}], got {most}")
    return DiscoveryConfig(
        dns=DnsName.parse(dns) if dns is not None else None,
        file=Path(file).expanduser().absolute() if file is not None else None,
        node_port=node_port,
        interval_s=_positive(args.discovery_interval_s, "--discovery-interval-s"),
        timeout_s=_positive(args.discovery_timeout_s, "--discovery-timeout-s"),
        max_backends=most)


def _tenants(args: argparse.Namespace, api_key: str | None) -> Tenants | None:
    salt = _first_secret(args.salt_secret_env, args.salt_secret_file, "salt secret")
    if not args.tenants_file:
        if salt:
            raise ConfigError("--salt-secret-*: only used with --tenants-file")
        return None
    return load_tenants(args.tenants_file, api_key, salt.encode() if salt else None)


def _first_secret(env: str | None, file: str | None, what: str) -> str | None:
    """The first secret of ``read_secrets`` (an owner-only file, else the variable)."""
    found = read_secrets(env, file, what)
    return found[0].decode(errors="replace") if found else None


def parse_urls(text: str, option: str) -> tuple[str, ...]:
    """``URL,URL,...`` as normalised base URLs (no trailing slash)."""
    out = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        parts = urlsplit(raw)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{option}: {redact_url(raw)!r} is not an http(s)://host:port URL")
        out.append(raw.rstrip("/"))
    return tuple(out)


def read_key(env: str | None, file: str | None, option: str) -> str | None:
    """An API key from a file or an environment variable, never from the command line."""
    if env and file:
        raise ConfigError(f"{option}-env and {option}-file: give one of them")
    if file:
        try:
            key = Path(file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{option}-file: cannot read {file}: {exc.strerror}") from exc
        if not key:
            raise ConfigError(f"{option}-file: {file} is empty")
        return key
    if env:
        key = os.environ.get(env, "").strip()
        if not key:
            raise ConfigError(f"{option}-env: environment variable {env} is not set or empty")
        return key
    return None


def _positive(value: float, option: str) -> float:
    if not value > 0:
        raise ConfigError(f"{option}: must be > 0, got {value}")
    return float(value)


def _weight(value: float, option: str) -> float:
    if not 0 <= value <= 100:  # NaN and infinity too
        raise ConfigError(f"{option}: must be between 0 and 100, got {value}")
    return float(value)


def _non_negative(value: float, option: str) -> float:
    if not value >= 0:
        raise ConfigError(f"{option}: must be >= 0, got {value}")
    return float(value)


def _port(value: int) -> int:
    if not 0 <= value <= 65535:
        raise ConfigError(f"--port: must be in [0, 65535], got {value}")
    return int(value)
