"""The node server's HTTP endpoint (``metrics_port``): metrics, health, and what it holds.

::

    GET  /metrics          Prometheus text format              (token: if metrics_need_token)
    GET  /healthz          {"ok": true, "instance": ..., "url": advertised URL,
                            "tiers": {name: breaker state}}
    GET  /v1/namespaces    [{"namespace": hex, "model": ..., "chunk_tokens": ..., ...}]
                           what engines registered (so a router can compute their keys)
                                                               (token)
    GET  /v1/stats         the store's stats                   (token)
    POST /v1/lookup        {"keys": [hex, ...]} -> {"tiers": [...], "arrival_s": [...],
                                                    "instance": ..., "shared": [tier, ...]}
                           the longest available prefix of the keys and when each could be
                           in the arena (the ``cache`` routing strategy asks this)  (token)

It binds ``metrics_host`` (127.0.0.1 by default; beyond loopback only with a token, see
:mod:`kvtier.address`) and tells in ``/healthz`` the URL others reach it at. It reveals
no KV, but ``/v1/lookup`` tells whoever can compute a prompt's keys whether that prompt
is cached, and ``/v1/namespaces`` hands out the fingerprints needed to compute them. With
a token (``auth.http_token_env`` / ``auth.http_token_file``) those paths answer only
``Authorization: Bearer TOKEN``; without one they answer anyone who can reach the bound
address.

Connections: at most ``max_connections`` at once, and each request — its headers and body —
must arrive whole within ``deadline_s`` of the connection opening or of the previous answer
(a per-read timeout lets a client trickling a byte a second hold a connection for ever).
When every place is taken, a new connection takes the place of the one that has waited
longest for its request's bytes (a trickler, or an idle keep-alive connection), so slow
clients cannot lock the others out; only when every connection is busy answering is a new
one closed at once.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.errors import InvalidRequest
from kvtier.keys import ChunkKey
from kvtier.protocol import MAX_KEYS

if TYPE_CHECKING:
    from kvtier.server.service import Service

log = logging.getLogger("kvtier.server")
MAX_BODY = 70 * MAX_KEYS + 4096
"""A lookup of MAX_KEYS keys fits: each is 64 hex digits, quotes, a comma and a space."""
MAX_CONNECTIONS = 32
"""Connections served at once (see the module docstring for who gives way to a new one)."""
PROTECTED = frozenset({"/v1/lookup", "/v1/namespaces", "/v1/stats"})
"""Paths that ask for the token when one is set (``/metrics`` too if so configured)."""


# ---------------------------------------------------------------------- connections

@dataclass
class _Conn:
    since: float
    """When it began waiting for its current request (monotonic)."""
    waiting: bool = True
    """Still waiting for (the rest of) a request; False while its answer is made."""


class Connections:
    """The connections the endpoint holds: at most ``limit``, and under pressure the one
    that has waited longest for its request's bytes gives its place up (it is shut down, so
    its handler's read ends at once). Threads are bounded too: an evicted connection's
    thread ends promptly, but until it has, it counts (at most ``2 * limit`` threads)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._threads = 0
        self.evicted = 0

    def admit(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._threads >= 2 * self.limit:
                return False
            if len(self._conns) >= self.limit:
                waiting = [(c.since, id(s), s) for s, c in self._conns.items() if c.waiting]
                if not waiting:
                    return False
                self._evict(min(waiting)[2])
            self._conns[sock] = _Conn(time.monotonic())
            self._threads += 1
            return True

    def mark(self, sock: socket.socket, *, waiting: bool) -> bool:
        """Record that ``sock`` waits for a request (from now) or answers one; False if it
        was evicted meanwhile (its handler stops)."""
        with self._lock:
            conn = self._conns.get(sock)
            if conn is None:
                return False
            conn.waiting = waiting
            if waiting:
                conn.since = time.monotonic()
            return True

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.pop(sock, None)
            self._threads -= 1

    def close_all(self) -> None:
        with self._lock:
            for sock in list(self._conns):
                self._evict(sock)

    def _evict(self, sock: socket.socket) -> None:
        del self._conns[sock]
        self.evicted += 1
        with contextlib.suppress(OSError):  # already gone: its thread ends on its own
            sock.shutdown(socket.SHUT_RDWR)


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each limited to what is left of the request's deadline: a client
    that trickles bytes gets no more time than one that sends nothing."""

    def __init__(self, sock: socket.socket, deadline: Callable[[], float]) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline() - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive whole within its deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``Connections.limit`` of them waiting or answering."""

    request_queue_size = 2 * MAX_CONNECTIONS  # the listen backlog (the default is 5)
    daemon_threads = True
    block_on_close = False  # stop() shuts every connection down instead of joining them

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int) -> None:
        if ":" in address[0]:  # an IPv6 address (``::`` also takes IPv4 where the host allows)
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)
        self.conns = Connections(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.conns.admit(request):
            log.debug("http: %d connections busy answering; closing one more",
                      self.conns.limit)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.conns.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.conns.release(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("http: connection from %s ended with an error", client_address,
                  exc_info=True)


# ---------------------------------------------------------------------- the endpoint

class NodeHTTP:
    def __init__(self, service: Service, host: str, port: int, *, deadline_s: float = 10.0,
                 max_connections: int = MAX_CONNECTIONS, tokens: Sequence[bytes] = (),
                 metrics_need_token: bool = False) -> None:
        """``deadline_s``: how long a request (headers and body) may take to arrive whole,
        from the connection's opening or its previous answer; also how long an answer may
        take to be sent. ``tokens``: the bearer tokens :data:`PROTECTED` paths accept (and
        ``/metrics`` with ``metrics_need_token``), several while one is rotated; none: they
        answer anyone."""
        self.service = service
        self._tokens = tuple(tokens)
        self.protected = PROTECTED | ({"/metrics"} if metrics_need_token else set())
        handler = type("Handler", (_Handler,), {"node": self, "deadline_s": deadline_s})
        self.server = _BoundedServer((host, port), handler, max_connections)
        self.port = int(self.server.server_address[1])
        self.url: str | None = None
        """The advertised URL (``/healthz``), set by whoever knows it."""
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="kvtier-http")

    def __repr__(self) -> str:  # never the token
        return f"NodeHTTP(port={self.port}, tokens={len(self._tokens)})"

    @property
    def needs_token(self) -> bool:
        return bool(self._tokens)

    def start(self) -> NodeHTTP:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.conns.close_all()
        self.server.server_close()

    # ------------------------------------------------------------------ answers

    def refusal(self, path: str, authorization: str | None) -> tuple[int, str, bytes] | None:
        """401 for a protected path without the right token; None: go on."""
        if not self._tokens or path not in self.protected:
            return None
        scheme, _, given = (authorization or "").strip().partition(" ")
        offered = given.strip().encode()
        # every listed token is compared, so the time taken says nothing of which one matched
        matches = [hmac.compare_digest(offered, token) for token in self._tokens]
        if scheme.lower() == "bearer" and any(matches):
            return None
        why = "a wrong bearer token" if authorization else "no Authorization header"
        return _json({"error": f"{path} needs 'Authorization: Bearer <token>' (the node "
                               f"server's auth.http_token_env / http_token_file); got {why}"},
                     401)

    def get(self, path: str) -> tuple[int, str, bytes]:
        store = self.service.store
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(store.metrics.registry)
        if path == "/healthz":
            tiers = {s.name: s.breaker.state.name.lower() for s in store.tiers}
            return _json({"ok": True, "instance": store.instance, "url": self.url,
                          "tiers": tiers})
        if path == "/v1/namespaces":
            # the full fingerprint wins over an engine's short form (its first 16 hex)
            return _json([{**info, "namespace": fp.hex()}
                          for fp, info in list(self.service.namespaces.items())])
        if path == "/v1/stats":
            return _json(store.stats())
        return _json({"error": f"no such path {path}"}, 404)

    def post(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        if path != "/v1/lookup":
            return _json({"error": f"no such path {path}"}, 404)
        try:
            keys = _keys(body)
            hit = self.service.store.lookup_hit(keys)
        except InvalidRequest as exc:
            return _json({"error": str(exc)}, 400)
        store = self.service.store
        return _json({"tiers": hit.tiers, "arrival_s": hit.arrival_s,
                      "instance": store.instance,
                      "shared": [s.name for s in store.tiers if s.tier.shared]})


def _keys(body: bytes) -> list[ChunkKey]:
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise InvalidRequest(f"body: not JSON ({exc})") from exc
    raw = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(raw, list) or len(raw) > MAX_KEYS:
        raise InvalidRequest(f"keys: expected a list of at most {MAX_KEYS} hex keys")
    keys = []
    for i, item in enumerate(raw):
        if not isinstance(item, str) or len(item) != 64:
            raise InvalidRequest(f"keys[{i}]: expected 64 hex characters")
        try:
            keys.append(ChunkKey(bytes.fromhex(item)))
        except ValueError as exc:
            raise InvalidRequest(f"keys[{i}]: not hex") from exc
    return keys


def _json(doc: Any, status: int = 200) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(doc, default=str).encode()


class _Handler(BaseHTTPRequestHandler):
    node: NodeHTTP
    deadline_s: float
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    """TCP_NODELAY: the headers and the body are two writes, and with Nagle's algorithm the
    body waited for the client's delayed ACK of the headers — 40 ms on a kept-alive
    connection, on every router lookup (24.6 ms mean per decision measured)."""
    _deadline = 0.0

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, lambda: self._deadline))

    def handle_one_request(self) -> None:
        self._deadline = time.monotonic() + self.deadline_s
        if not self._conns.mark(self.connection, waiting=True):
            self.close_connection = True
            return
        super().handle_one_request()

    @property
    def _conns(self) -> Connections:
        return self.server.conns  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if not self._answering():
            return
        self._answer(*(self.node.refusal(path, self.headers.get("Authorization"))
                       or self.node.get(path)))

    def do_POST(self) -> None:
        raw = self.headers.get("Content-Length") or "0"
        length = int(raw) if raw.isascii() and raw.isdigit() else -1
        if length < 0:
            self.close_connection = True  # what follows the headers cannot be framed
            self._answer(*_json({"error": f"Content-Length: not a byte count ({raw!r})"}, 400))
            return
        if length > MAX_BODY:
            self.close_connection = True  # its body is left unread
            self._answer(*_json({"error": f"body over {MAX_BODY} bytes"}, 413))
            return
        # read even a body that will be refused: closing on unread bytes resets the
        # connection, and the client might never see why
        body = self.rfile.read(length)  # TimeoutError at the deadline: dropped unanswered
        if len(body) < length:
            self.close_connection = True  # the client stopped sending (or was evicted)
            return
        if self._answering():
            path = self.path.split("?")[0]
            self._answer(*(self.node.refusal(path, self.headers.get("Authorization"))
                           or self.node.post(path, body)))

    def _answering(self) -> bool:
        """The request is whole: its connection is no longer one a newcomer may evict."""
        if self._conns.mark(self.connection, waiting=False):
            return True
        self.close_connection = True
        return False

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.connection.settimeout(self.deadline_s)  # a client that does not read is cut off
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="kvtier"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)  # the request line; never a header
