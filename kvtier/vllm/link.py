"""The connector's line to the node server: every failure becomes a miss.

vLLM must never stall or crash because the cache is gone. :class:`ServerLink` wraps a
:class:`~kvtier.client.KvtierClient` so that each call either returns the server's answer or
a neutral value (no hit, no slot), and after a failure it stops calling for
``retry_interval_s`` instead of paying a connection attempt (or a timeout) on every step.
The client reconnects by itself on the next call after that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from kvtier.errors import ClientError, RequestRejected, ServerUnavailable
from kvtier.keys import ChunkKey

log = logging.getLogger("kvtier.vllm")
T = TypeVar("T")


class LeaseLike(Protocol):
    lease_id: int
    slots: list[int]
    tiers: list[str]
    ready: bool


class LeaseStatusLike(Protocol):
    ready: list[bool]
    failed: list[bool]
    done: bool


class HelloLike(Protocol):
    @property
    def arena_id(self) -> str: ...


class ClientLike(Protocol):
    """The part of :class:`kvtier.client.KvtierClient` the scheduler side uses."""

    def connect(self, *, refresh: bool = False) -> HelloLike: ...
    def lookup(self, keys: Sequence[ChunkKey], *, namespace: str = "", prompt_tokens: int = 0,
               chunk_tokens: int = 0) -> list[str]: ...
    def lease(self, keys: Sequence[ChunkKey]) -> LeaseLike: ...
    def poll(self, lease_id: int) -> LeaseStatusLike: ...
    def release(self, lease_id: int) -> None: ...
    def reserve(self, namespace_fp: bytes, keys: Sequence[ChunkKey], *, payload_len: int,
                tokens: int, priority: int = 35, first_index: int = 0) -> list[int | None]: ...
    def commit(self, keys: Sequence[ChunkKey]) -> int: ...
    def abort(self, keys: Sequence[ChunkKey]) -> int: ...
    def set_priority(self, keys: Sequence[ChunkKey], priority: int) -> None: ...
    def report(self, client: str, counters: dict[str, float]) -> int: ...
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

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
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

    def arena_name(self) -> str | None:
        return self._call("hello", lambda: self.client.connect().arena_id, None)

    def lookup(self, keys: Sequence[ChunkKey], namespace: str, prompt_tokens: int,
               chunk_tokens: int) -> list[str]:
        return self._call("lookup", lambda: self.client.lookup(
            keys, namespace=namespace, prompt_tokens=prompt_tokens,
            chunk_tokens=chunk_tokens), [])

    def lease(self, keys: Sequence[ChunkKey]) -> LeaseLike | None:
        return self._call("lease", lambda: self.client.lease(keys), None)

    def poll(self, lease_id: int) -> LeaseStatusLike | None:
        return self._call("poll", lambda: self.client.poll(lease_id), None)

    def release(self, lease_id: int) -> None:
        self._call("release", lambda: self.client.release(lease_id), None)

    def reserve(self, namespace_fp: bytes, keys: Sequence[ChunkKey], *, payload_len: int,
                tokens: int, priority: int, first_index: int) -> list[int | None]:
        return self._call("reserve", lambda: self.client.reserve(
            namespace_fp, keys, payload_len=payload_len, tokens=tokens, priority=priority,
            first_index=first_index), [None] * len(keys))

    def commit(self, keys: Sequence[ChunkKey]) -> int:
        return self._call("commit", lambda: self.client.commit(keys), 0)

    def abort(self, keys: Sequence[ChunkKey]) -> None:
        self._call("abort", lambda: self.client.abort(keys), 0)

    def set_priority(self, keys: Sequence[ChunkKey], priority: int) -> None:
        self._call("set_priority", lambda: self.client.set_priority(keys, priority), None)

    def report(self, client: str, counters: dict[str, float]) -> None:
        self._call("report", lambda: self.client.report(client, counters), 0)

    def close(self) -> None:
        self.client.close()
