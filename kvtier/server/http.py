"""The node server's HTTP endpoint (``metrics_port``): metrics, health, and what it holds.

::

    GET  /metrics          Prometheus text format
    GET  /healthz          {"ok": true, "instance": ..., "tiers": {name: breaker state}}
    GET  /v1/namespaces    [{"namespace": hex, "model": ..., "chunk_tokens": ..., ...}]
                           what engines registered (so a router can compute their keys)
    GET  /v1/stats         the store's stats
    POST /v1/lookup        {"keys": [hex, ...]} -> {"tiers": [...], "arrival_s": [...]}
                           the longest available prefix of the keys and when each could be
                           in the arena (the ``cache`` routing strategy asks this)

It binds ``metrics_host`` (127.0.0.1 by default). It reveals no KV: keys are hashes that only
someone who holds the prompt can compute; still, expose it only where /metrics may be seen.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.errors import InvalidRequest
from kvtier.keys import ChunkKey
from kvtier.protocol import MAX_KEYS

if TYPE_CHECKING:
    from kvtier.server.service import Service

log = logging.getLogger("kvtier.server")
MAX_BODY = 64 * MAX_KEYS + 4096
MAX_CONNECTIONS = 32
"""Connections served at once; one more is closed at once (a scraper or router retries)."""


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them."""

    request_queue_size = 2 * MAX_CONNECTIONS  # the listen backlog (the default is 5)

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("http: %d connections already; closing one more", MAX_CONNECTIONS)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class NodeHTTP:
    def __init__(self, service: Service, host: str, port: int, *, timeout_s: float = 10.0,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        """``timeout_s``: how long a connection may keep a handler waiting for its next
        bytes (a client that opens one and sends nothing is closed then)."""
        self.service = service
        handler = type("Handler", (_Handler,), {"node": self, "timeout": timeout_s})
        self.server = _BoundedServer((host, port), handler, max_connections)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="kvtier-http")

    def start(self) -> NodeHTTP:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ answers

    def get(self, path: str) -> tuple[int, str, bytes]:
        store = self.service.store
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(store.metrics.registry)
        if path == "/healthz":
            tiers = {s.name: s.breaker.state.name.lower() for s in store.tiers}
            return _json({"ok": True, "instance": store.instance, "tiers": tiers})
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
        return _json({"tiers": hit.tiers, "arrival_s": hit.arrival_s,
                      "instance": self.service.store.instance})


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
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(*self.node.get(self.path.split("?")[0]))

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
        self._answer(*self.node.post(self.path, self.rfile.read(length)))

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)
