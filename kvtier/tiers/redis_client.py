"""redis-py set up for a tier: one bounded pool, fast failures, kvtier errors.

redis-py's own retries are turned off (redis-py 8 retries a refused AUTH and every connection
error ten times with backoff by default, seconds before an error surfaces; and it nests the
connect retry inside the command retry). :class:`Calls` applies the tier's policy instead:
a refused or reset connection is retried ``retries`` times (a restarted server is then picked
up through a stale pooled socket), a timeout or a refused login never is. So a call fails
within about ``(1 + retries) x connect_timeout_s`` on a dead host and ``socket_timeout_s`` on
a hung one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    OutOfMemoryError,
    RedisError,
)
from redis.retry import Retry

from kvtier.errors import TierFull, TierIOError, TierTimeout
from kvtier.tiers.redis_nodes import ClusterNodes, SingleNode
from kvtier.tiers.redis_options import RedisOptions

T = TypeVar("T")
_POOL_EMPTY = "No connection available"


class HiddenCredentials(CredentialProvider):
    """Hands redis-py the login at connect time; its repr never shows the password."""

    def __init__(self, username: str | None, password: str) -> None:
        self._username = username
        self._password = password

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        if self._username:
            return (self._username, self._password)
        return (self._password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()

    def __repr__(self) -> str:
        return f"HiddenCredentials(username={self._username!r}, password=<hidden>)"


def make_nodes(options: RedisOptions, password: str | None) -> SingleNode | ClusterNodes:
    """The server, or the cluster's nodes (each on a pool of its own, made when first used)."""
    endpoint = options.endpoint
    if not options.cluster:
        return SingleNode(make_client(options, password))
    return ClusterNodes([(endpoint.host, endpoint.port), *options.seed_nodes],
                        lambda host, port: make_client(options, password, (host, port)))


def make_client(options: RedisOptions, password: str | None,
                address: tuple[str, int] | None = None) -> redis.Redis:
    """A client on a pool of at most ``max_connections``; connects lazily. ``address``: a
    cluster node's, instead of the URL's host and port."""
    endpoint = options.endpoint
    username = options.username or endpoint.username
    host, port = address or (endpoint.host, endpoint.port)
    kwargs: dict[str, Any] = {
        "host": host, "port": port, "db": endpoint.db,
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if password is not None:
        kwargs["credential_provider"] = HiddenCredentials(username, password)
    if endpoint.tls:
        kwargs.update(connection_class=redis.SSLConnection, ssl_ca_certs=options.ca_bundle,
                      ssl_cert_reqs="required" if options.verify else "none",
                      ssl_check_hostname=options.verify)
    pool = redis.BlockingConnectionPool(max_connections=options.max_connections,
                                        timeout=options.socket_timeout_s, **kwargs)
    return redis.Redis(connection_pool=pool)


class Calls:
    """Runs one tier's redis calls under its retry policy, raising kvtier errors."""

    def __init__(self, tier: str, options: RedisOptions, secret: str | None,
                 on_connection_error: Callable[[], None] = lambda: None) -> None:
        self.tier = tier
        self.on_connection_error = on_connection_error
        self.retries = options.retries
        self.backoff_s = options.retry_backoff_s
        self._secret = secret

    def run(self, what: str, call: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return call()
            except RedisError as exc:
                if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                    self.on_connection_error()  # a cluster reloads its map before the next
                if attempt == self.retries or not _retryable(exc):
                    raise self.translate(exc, what) from exc
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")  # the last attempt returns or raises

    def translate(self, exc: RedisError, what: str) -> TierIOError:
        where = f"redis tier {self.tier}: {what}"
        if isinstance(exc, AuthenticationError | AuthorizationError | NoPermissionError):
            return TierIOError(f"{where}: the server refused the login or the command "
                               f"({type(exc).__name__}); check username and the password "
                               "source (password_env, password_file or the url)")
        detail = self._scrub(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, redis.TimeoutError) or _POOL_EMPTY in str(exc):
            return TierTimeout(f"{where}: no answer in time: {detail}")
        if isinstance(exc, OutOfMemoryError) or str(exc).startswith("OOM "):
            return TierFull(f"{where}: the server is at maxmemory: {detail}")
        return TierIOError(f"{where}: {detail}")

    def _scrub(self, text: str) -> str:
        """Defence in depth: redis-py's messages carry no password, and never will here."""
        return text.replace(self._secret, "***") if self._secret else text


def _retryable(exc: RedisError) -> bool:
    return (isinstance(exc, redis.ConnectionError)
            and not isinstance(exc, AuthenticationError | AuthorizationError)
            and _POOL_EMPTY not in str(exc))
