"""The connector's line to the node server: every failure becomes a miss.

vLLM must never stall or crash because the cache is gone. :class:`ServerLink` wraps a
:class:`~kvtier.client.KvtierClient` so that each call either returns the server's answer or
a neutral value the caller names (no hit, no slot), and after a failure it stops calling for
``retry_interval_s`` instead of paying a connection attempt (or a timeout) on every step.
The client reconnects by itself on the next call after that, in the same session, so the
leases and reservations taken before the failure are still its own.

A connection that dies under a call is retried once at once, when that is safe: always for
calls that can be repeated (lookups, polls, commits, aborts, releases), and for those that
cannot (:data:`NOT_REPEATABLE`: a second Reserve or Lease would find the first one's
reservation or take a second lease) only when the reconnect meets a new server start, which
kept nothing of the first. Otherwise the server may have done it and only the reply was
lost: the call returns the neutral value and the caller's ``undo`` is sent (the scheduler
side aborts the reservations a lost Reserve may have taken); a lost Lease cannot be named and
expires after the server's ``lease_ttl_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvtier.errors import ClientError, RequestRejected, ServerUnavailable
from kvtier.protocol import Lease, Op, R, Report, Reserve

log = logging.getLogger("kvtier.vllm")
T = TypeVar("T")
D = TypeVar("D")
NOT_REPEATABLE: tuple[type, ...] = (Reserve, Lease, Report)
"""Calls a server that did them once would answer differently (or count twice) if sent
again: retried after a dropped connection only when the server restarted meanwhile."""


class HelloLike(Protocol):
    @property
    def arena_id(self) -> str: ...


class ClientLike(Protocol):
    """The part of :class:`kvtier.client.KvtierClient` the scheduler side uses."""

    def connect(self, *, refresh: bool = False) -> HelloLike: ...
    def call(self, request: Op[R], extra_timeout: float = 0.0) -> R: ...
    def close(self) -> None: ...


class ServerLink:
    def __init__(self, client: ClientLike, retry_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self.failures = 0
        """Calls that found the server unreachable (a counter for stats)."""
        self._down_until = 0.0
        self._was_down = False

    @property
    def available(self) -> bool:
        return self.clock() >= self._down_until

    def call(self, request: Op[R], default: D, undo: Op[Any] | None = None) -> R | D:
        """The server's reply to ``request``, or ``default`` when it cannot be had.

        ``undo`` (for a :data:`NOT_REPEATABLE` request) is sent when the connection died
        under ``request`` but the server did not restart: it may have done it."""
        what = type(request).__name__.lower()
        repeatable = not isinstance(request, NOT_REPEATABLE)
        return self._guard(what, lambda: self.client.call(request), default, repeatable, undo)

    def arena_name(self) -> str | None:
        return self._guard("hello", lambda: self.client.connect().arena_id, None)

    def _guard(self, what: str, fn: Callable[[], T], default: D, repeatable: bool = True,
               undo: Op[Any] | None = None) -> T | D:
        if not self.available:
            return default
        try:
            server = None if repeatable else self.client.connect().arena_id
            try:
                result = fn()
            except ServerUnavailable as exc:
                if not isinstance(exc.__cause__, ConnectionError):
                    raise
                # A connection that died under us: the client has dropped it, so one retry
                # reconnects at once (a timeout is not retried). A call that must not be
                # repeated is retried only if the server restarted (it kept nothing).
                if server is not None and self.client.connect().arena_id == server:
                    log.warning("kvtier connection lost during %s (server still up): "
                                "not repeated, it may have been done", what)
                    if undo is not None:
                        self.client.call(undo)
                    return default
                result = fn()
        except RequestRejected as exc:
            log.warning("kvtier server refused %s: %s", what, exc)
            return default
        except ClientError as exc:
            self.failures += 1
            self._down_until = self.clock() + self.retry_interval_s
            if not self._was_down:
                log.warning("kvtier server unavailable (%s); serving by recompute: %s",
                            what, exc)
            self._was_down = True
            return default
        if self._was_down:
            log.info("kvtier server reachable again")
            self._was_down = False
        return result

    def close(self) -> None:
        self.client.close()
