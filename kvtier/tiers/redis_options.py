"""The ``redis`` tier's options, its endpoint and where its password comes from.

A password is never a config value of its own (configs get logged, copied into tickets and
checked into repositories): it comes from an environment variable named by ``password_env``
or a file readable by its owner only (``password_file``). One inside the URL is accepted, for
compatibility with the usual ``redis://user:pass@host`` form, but is cut out of the URL at once:
``repr``, :meth:`Endpoint.redacted`, ``describe()``, logs and errors never show it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import unquote, urlsplit

import msgspec
from msgspec import Meta

from kvtier.auth import read_private_file
from kvtier.bounds import NonNegative, Positive, check_bounds
from kvtier.config import ConfigStruct, parse
from kvtier.errors import ConfigError

_PREFIX = re.compile(r"[A-Za-z0-9_.:/{}-]{1,100}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HOST = re.compile(r"[A-Za-z0-9_.:%-]{1,253}")


REFUSED_PASSWORD = ("a password is never read from the config, which gets logged and copied: "
                    "name an environment variable in password_env or a mode-0600 file in "
                    "password_file")


def parse_options(own: Mapping[str, Any], where: str) -> RedisOptions:
    """The tier's own keys (the sharing keys split off) into :class:`RedisOptions`."""
    if "password" in own:
        raise ConfigError(f"{where}.password: {REFUSED_PASSWORD}")
    return parse(RedisOptions, own, where)


class RedisOptions(ConfigStruct, frozen=True, repr_omit_defaults=False):
    """``options`` of a ``redis`` tier (besides the sharing keys of every shared tier)."""

    url: str
    """``redis://host:port/db`` or ``rediss://`` (TLS); Valkey speaks the same protocol."""
    username: str | None = None
    """An ACL user (Redis 6+); also accepted in the URL."""
    password_env: str | None = None
    """The name of an environment variable that holds the password."""
    password_file: str | None = None
    """A file holding the password (trailing newline ignored); mode 0600 or stricter."""
    ca_bundle: str | None = None
    """PEM file of the CAs to trust (rediss only; default: the system's)."""
    verify: bool = True
    """Check the server's certificate and host name (rediss only)."""
    key_prefix: str = "kvtier:"
    max_connections: Annotated[int, Meta(ge=1, le=1024)] = 16
    """Connections in the pool; a call waits up to ``socket_timeout_s`` for a free one."""
    socket_timeout_s: Positive = 5.0
    connect_timeout_s: Positive = 2.0
    retries: Annotated[int, Meta(ge=0, le=10)] = 1
    """Retries of a call that failed on a refused or reset connection (not on a timeout, not
    on a refused login): one picks up a restarted server through a stale pooled socket."""
    retry_backoff_s: NonNegative = 0.05
    """Wait before the first retry, doubled for each further one."""
    cluster: bool = False
    """The url names one node of a Redis (or Valkey) Cluster: the tier learns the others from
    it and sends each key to the primary that serves its hash slot (docs/shared.md)."""
    nodes: list[str] = []
    """More cluster nodes (``host:port``) to ask for the slot map when the url's does not
    answer (a tier that starts while that node is down)."""
    chunk_ttl_s: Annotated[float, Meta(ge=1)] | None = None
    """Chunks expire this long after their last write or touch (``volatile-*`` eviction
    policies evict only keys with a TTL); the index and notes never expire."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if not _PREFIX.fullmatch(self.key_prefix):
            raise ConfigError("key_prefix: 1-100 of letters, digits and _ . : / { } -")
        if self.password_env is not None and not _ENV_NAME.fullmatch(self.password_env):
            raise ConfigError("password_env: the *name* of an environment variable "
                              "(letters, digits, '_'), not the password")
        if self.password_env is not None and self.password_file is not None:
            raise ConfigError("password_env, password_file: give one password source")
        endpoint = Endpoint.parse(self.url)
        if self.cluster and endpoint.db != 0:
            raise ConfigError("url: a Redis Cluster has only database 0 (redis://host:port/0) "
                              "with cluster: true")
        if self.nodes and not self.cluster:
            raise ConfigError("nodes: only with cluster: true")
        if len(self.nodes) > 64:
            raise ConfigError("nodes: at most 64 (the cluster tells the tier the rest)")
        for node in self.nodes:
            _host_port(node)
        if self.cluster and ("{" in self.key_prefix or "}" in self.key_prefix):
            raise ConfigError("key_prefix: no { or } with cluster: true (the tier puts the "
                              "hash tags that place keys on slots itself)")
        if not endpoint.tls and (self.ca_bundle is not None or not self.verify):
            raise ConfigError("ca_bundle, verify: only for TLS (a rediss:// url)")
        if endpoint.password is not None and (self.password_env or self.password_file):
            raise ConfigError("url: holds a password and password_env/password_file gives "
                              "another; give one password source")
        if endpoint.username and self.username and endpoint.username != self.username:
            raise ConfigError("username: differs from the user in url")

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint.parse(self.url)

    @property
    def seed_nodes(self) -> list[tuple[str, int]]:
        """``nodes`` as (host, port)."""
        return [_host_port(node) for node in self.nodes]

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}"
                          for name, value in msgspec.structs.asdict(self).items()
                          if name != "url")
        return f"RedisOptions(url={self.endpoint.redacted()!r}, {shown})"


@dataclass(frozen=True, repr=False)
class Endpoint:
    """A parsed ``redis://`` or ``rediss://`` URL; its password is never shown."""

    tls: bool
    host: str
    port: int
    db: int
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        try:
            host, port = parts.hostname, parts.port or 6379
        except ValueError as exc:  # a bad port: the message never echoes the url
            raise ConfigError("url: the port must be a number in [1, 65535]") from exc
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError("url: expected redis://host:port/db or rediss://... (TLS), "
                              f"got scheme {parts.scheme!r}")
        if not host:
            raise ConfigError("url: names no host (redis://host:port/db)")
        if parts.query or parts.fragment:
            raise ConfigError("url: query parameters are not read; use the tier's options")
        db_text = parts.path.lstrip("/")
        if db_text and not db_text.isdigit():
            raise ConfigError("url: the path is the database number (redis://host:port/0)")
        return cls(parts.scheme == "rediss", host, port, int(db_text or 0),
                   unquote(parts.username) if parts.username else None,
                   unquote(parts.password) if parts.password is not None else None)

    def redacted(self) -> str:
        """The URL without its password: what describe() and logs show."""
        user = f"{self.username}@" if self.username else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{user}{host}:{self.port}/{self.db}"

    def __repr__(self) -> str:
        return f"Endpoint({self.redacted()!r})"


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"nodes: {node!r} is not host:port (a port in [1, 65535])")
    return host, int(port)


def load_password(options: RedisOptions, where: str) -> str | None:
    """The password from the source ``options`` name (or the URL); ``None`` for none."""
    if options.password_env is not None:
        value = os.environ.get(options.password_env)
        if not value:
            raise ConfigError(f"{where}.password_env: the environment variable "
                              f"{options.password_env} is not set or empty")
        return value
    if options.password_file is not None:
        return _read_password_file(options.password_file, f"{where}.password_file")
    return options.endpoint.password


def _read_password_file(path: str, where: str) -> str:
    raw, _ = read_private_file(path, where)
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:  # its message would quote bytes of the password
        raise ConfigError(f"{where}: {path!r} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{where}: {path!r} is empty")
    return text
