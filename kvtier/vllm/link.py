"""The connector's line to the node server: every failure becomes a miss.

vLLM must never stall or crash because the cache is gone. :class:`ServerLink` wraps a
:class:`~kvtier.client.KvtierClient` so that each call either returns the server's answer or
a neutral value the caller names (no hit, no slot), and after a failure it stops calling for
``retry_interval_s`` instead of paying a connection attempt (or a timeout) on every step.
The client reconnects by itself on the next call after that, in the same session, so the
leases and reservations taken before the failure are still its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from kvtier.errors import ClientError, RequestRejected, ServerUnavailable
from kvtier.protocol import Op, R

log = logging.getLogger("kvtier.vllm")
T = TypeVar("T")
D = TypeVar("D")


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

    def call(self, request: Op[R], default: D) -> R | D:
        """The server's reply to ``request``, or ``default`` when it cannot be had."""
        what = type(request).__name__.lower()
        return self._guard(what, lambda: self.client.call(request), default)

    def arena_name(self) -> str | None:
        return self._guard("hello", lambda: self.client.connect().arena_id, None)

    def _guard(self, what: str, fn: Callable[[], T], default: D) -> T | D:
        if not self.available:
            return default
        try:
            try:
                result = fn()
            except ServerUnavailable as exc:
                if not isinstance(exc.__cause__, ConnectionError):
                    raise
                # A connection that died under us (the server restarted): the client has
                # dropped it, so one retry reconnects at once. A timeout is not retried.
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
