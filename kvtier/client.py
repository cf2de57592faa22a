"""The engine-side client of the node server: control socket + arena mapping.

Every call either returns the server's answer or raises:

- :class:`~kvtier.errors.ServerUnavailable` when the server cannot be reached (not started,
  gone, timed out). The connection is dropped; the next call reconnects. Engines turn this into
  misses (and skipped stores): the cache is an accelerator, never a dependency.
- :class:`~kvtier.errors.RequestRejected` when the request was refused (``.code`` says by
  what rule, the message why): by the server, or before sending when an argument can never
  be valid (a NaN timeout). The connection stays usable.

Every operation of :mod:`kvtier.protocol` is sent with :meth:`KvtierClient.call`; the named
methods are shorthands for it. A client object has one session: after a reconnect it still
owns the leases and reservations it took (within the server's ``orphan_grace_s``).

The client is thread-safe (one request at a time on its socket). Payloads move through the
arena: ``payload_view(slot, n)`` is a numpy view of a slot's payload region, no copy.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import socket
import threading
from collections.abc import Sequence

import numpy as np

from kvtier.errors import ProtocolError, RequestRejected, ServerUnavailable
from kvtier.keys import ChunkKey
from kvtier.protocol import (
    MAX_WAIT_S,
    Abort,
    Commit,
    Error,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    LeaseStatus,
    Lookup,
    LookupReply,
    Op,
    R,
    Release,
    Report,
    Reserve,
    SetPriority,
    Stats,
    Wait,
    decode_reply,
    encode,
    read_frame,
)
from kvtier.tiers.arena import ArenaMapping

MAX_REPLY_BYTES = 64 << 20

__all__ = ["KvtierClient", "LeaseReply", "LeaseStatus", "LookupReply"]


class KvtierClient:
    def __init__(self, socket_path: str, *, name: str = "client", timeout_s: float = 5.0
                 ) -> None:
        self.socket_path = socket_path
        self.name = name
        self.timeout_s = timeout_s
        self.session = secrets.token_hex(16)
        self._sock: socket.socket | None = None
        self._hello: HelloReply | None = None
        self._arena: ArenaMapping | None = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, *, refresh: bool = False) -> HelloReply:
        """Connect (if needed) and return the server's hello. ``refresh`` asks the server
        again, so a restart behind a connection that looked alive is noticed."""
        with self._lock:
            if refresh and self._sock is not None:
                with contextlib.suppress(ServerUnavailable):  # dropped: reopened below
                    self._hello = self._roundtrip(self._hello_message())
            if self._sock is None or self._hello is None:
                self._open()
            assert self._hello is not None
            return self._hello

    def _open(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise ServerUnavailable(
                f"kvtier server not reachable at {self.socket_path}: {exc}") from exc
        self._sock = sock
        hello = self._roundtrip(self._hello_message())
        if self._arena is not None and (self._hello is None
                                        or self._hello.instance != hello.instance):
            self._arena.close()  # the server restarted: a new arena, maybe under the same name
            self._arena = None
        self._hello = hello

    def _hello_message(self) -> Hello:
        return Hello(self.name[:200], os.getpid(), session=self.session)

    def close(self) -> None:
        with self._lock:
            self._drop()
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None

    def __enter__(self) -> KvtierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ arena

    @property
    def arena(self) -> ArenaMapping:
        """The server's arena, mapped into this process on first use."""
        with self._lock:
            hello = self.connect()
            if self._arena is None:
                self._arena = ArenaMapping(hello.arena_name, hello.num_slots, hello.slot_bytes,
                                           create=False)
            return self._arena

    @property
    def slot_bytes(self) -> int:
        return self.connect().slot_bytes

    @property
    def header_size(self) -> int:
        return self.connect().header_size

    def payload_view(self, slot: int, payload_len: int) -> np.ndarray:
        """uint8 view of the payload region of ``slot`` (no copy)."""
        start = self.header_size
        return self.arena.array[slot, start : start + payload_len]

    # ------------------------------------------------------------------ requests

    def call(self, request: Op[R], extra_timeout: float = 0.0) -> R:
        """Send any operation and return its reply (see the module docstring for errors)."""
        with self._lock:
            if self._sock is None:
                self._open()
            return self._roundtrip(request, extra_timeout)

    def lookup(self, keys: Sequence[ChunkKey], *, namespace: str = "", prompt_tokens: int = 0,
               chunk_tokens: int = 0) -> list[str]:
        return self.lookup_hit(keys, namespace=namespace, prompt_tokens=prompt_tokens,
                               chunk_tokens=chunk_tokens).tiers

    def lookup_hit(self, keys: Sequence[ChunkKey], *, namespace: str = "",
                   prompt_tokens: int = 0, chunk_tokens: int = 0) -> LookupReply:
        """Tiers of the available prefix with each chunk's estimated arrival."""
        return self.call(Lookup(list(keys), namespace, prompt_tokens, chunk_tokens))

    def lease(self, keys: Sequence[ChunkKey]) -> LeaseReply:
        return self.call(Lease(list(keys)))

    def wait(self, lease_id: int, timeout_s: float) -> LeaseStatus:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s)
                and timeout_s >= 0):
            raise RequestRejected(f"bad_request: timeout_s must be a finite number >= 0, "
                                  f"got {timeout_s!r}", code="bad_request")
        timeout_s = min(float(timeout_s), MAX_WAIT_S)
        return self.call(Wait(lease_id, timeout_s), extra_timeout=timeout_s)

    def poll(self, lease_id: int) -> LeaseStatus:
        return self.call(Wait(lease_id, 0.0))

    def release(self, lease_id: int) -> None:
        self.call(Release(lease_id))

    def reserve(self, namespace_fp: bytes, keys: Sequence[ChunkKey], *, payload_len: int,
                tokens: int, priority: int = 35, first_index: int = 0,
                retain_s: float | None = None, tenant: str | None = None
                ) -> list[int | None]:
        request = Reserve(namespace_fp, list(keys), payload_len, tokens, priority, first_index,
                          retain_s, tenant)
        return self.call(request).slots

    def commit(self, keys: Sequence[ChunkKey]) -> int:
        return self.call(Commit(list(keys))).count

    def abort(self, keys: Sequence[ChunkKey]) -> int:
        return self.call(Abort(list(keys))).count

    def set_priority(self, keys: Sequence[ChunkKey], priority: int,
                     retain_s: float | None = None, *, keep_stronger: bool = False,
                     tenant: str | None = None) -> None:
        """Keep ``keys`` (a prefix, head first) at ``priority`` for ``retain_s`` seconds
        (``None``: until changed), within ``tenant``'s quota; priority 0 releases them."""
        self.call(SetPriority(list(keys), priority, retain_s, keep_stronger, tenant))

    def report(self, client: str, counters: dict[str, float]) -> int:
        """Add engine-side counter increments to the server's /metrics."""
        return self.call(Report(client, counters)).count

    def stats(self) -> dict[str, object]:
        return self.call(Stats()).stats

    # ------------------------------------------------------------------ transport

    def _roundtrip(self, request: Op[R], extra_timeout: float = 0.0) -> R:
        sock = self._sock
        assert sock is not None
        try:
            sock.settimeout(self.timeout_s + extra_timeout)
            sock.sendall(encode(request))
            body = read_frame(sock, MAX_REPLY_BYTES)
            if body is None:
                raise ConnectionError("server closed the connection")
            reply = decode_reply(body)
        except (OSError, ProtocolError) as exc:
            self._drop()
            raise ServerUnavailable(f"kvtier server at {self.socket_path}: {exc}") from exc
        if isinstance(reply, Error):
            if reply.code in ("protocol", "version", "busy"):
                self._drop()  # the server closed this connection
            if reply.code in ("busy",):
                raise ServerUnavailable(f"kvtier server at {self.socket_path}: "
                                        f"{reply.message}")
            raise RequestRejected(f"{reply.code}: {reply.message}", code=reply.code)
        if not isinstance(reply, type(request).REPLY):
            self._drop()
            raise ServerUnavailable(f"unexpected reply {type(reply).__name__} to "
                                    f"{type(request).__name__}")
        return reply  # type: ignore[return-value]
