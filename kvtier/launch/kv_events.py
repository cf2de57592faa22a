"""The instances' KV-event streams, relayed on 127.0.0.1 for a router that follows them.

``kvtier serve --instances N --router vllm-router --router-policy kv_aware`` turns on each
instance's KV events (vLLM's ``--kv-events-config``): the device prefix cache's
``BlockStored`` / ``BlockRemoved`` and, through kvtier's connector, what its tiers hold
(:mod:`kvtier.vllm.kv_events`). vllm-router subscribes to one ``tcp://HOST:PORT`` per worker
and connects to it; vLLM 0.32's publisher binds only a wildcard TCP address (every interface)
or an ``ipc://`` path, and connects for any other TCP address. A stack that listens on
127.0.0.1 only therefore has instance i publish on an ipc path of its own, and relays it:

::

    instance i's publisher  ──ipc://RUNTIME/stack-PID-i.kv-events──▶  SUB ┐ relay (a thread
    vllm-router's SUB  ◀──tcp://127.0.0.1:P+201+i──  PUB ◀──────────────────┘ of kvtier serve)

Messages pass unchanged (vLLM's topic, sequence number and msgpack payload). Each stream holds
at most :data:`HWM` messages; past that ZMQ's PUB drops, so a slow router misses events (and
routes on an older view) but never slows an engine or the stack. A restarted instance binds its
path again and the relay's SUB reconnects on its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("kvtier.launch")

HWM = 100_000
"""Messages queued per stream (in and out) before ZMQ drops: vLLM's own default."""
TOPIC = ""
"""vLLM's default topic. vllm-router's static ``--kv-event-source`` follows only that one: it
has no option for another, and drops every message published under another topic (its index
stays empty and ``kv_aware`` credits no prefix)."""
POLL_MS = 200


def relay_endpoint(port: int, host: str = "127.0.0.1") -> str:
    """Where the relay republishes a stream (what vllm-router's ``--kv-event-source`` names)."""
    return f"tcp://{host}:{port}"


def instance_events_config(endpoint: str) -> str:
    """The ``--kv-events-config`` of an instance publishing on ``endpoint``."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": endpoint, "topic": TOPIC})


class KvEventRelay:
    """Relays ``sources[i]`` (ipc paths vLLM binds) to ``tcp://127.0.0.1:ports[i]``.

    :meth:`start` binds every output before it returns (a taken port fails there, naming it),
    then forwards on one thread until :meth:`stop`."""

    def __init__(self, sources: Sequence[str], ports: Sequence[int],
                 host: str = "127.0.0.1") -> None:
        if len(sources) != len(ports):
            raise ValueError(f"{len(sources)} sources for {len(ports)} ports")
        self.sources = list(sources)
        self.endpoints = [relay_endpoint(port, host) for port in ports]
        self.forwarded = [0] * len(self.sources)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: Any = None
        self._pairs: list[tuple[Any, Any]] = []
        self._sockets: list[Any] = []

    def start(self) -> None:
        import zmq

        self._context = zmq.Context()
        try:
            for source, endpoint in zip(self.sources, self.endpoints, strict=True):
                sub = self._socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, HWM)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(source)  # the path need not exist yet: ZMQ retries
                pub = self._socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, HWM)
                try:
                    pub.bind(endpoint)
                except zmq.ZMQError as exc:
                    raise OSError(f"KV-event relay: cannot listen on {endpoint} ({exc})") from exc
                self._pairs.append((sub, pub))
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> Any:
        import zmq

        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)  # closed by _close, paired or not (else term() hangs)
        return sock

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        index = {}
        for i, (sub, _) in enumerate(self._pairs):
            poller.register(sub, zmq.POLLIN)
            index[sub] = i
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(POLL_MS):
                    i = index[sock]
                    pub = self._pairs[i][1]
                    while True:  # drain what is there, then poll again
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        pub.send_multipart(parts, zmq.NOBLOCK, copy=False)
                        self.forwarded[i] += 1
        except zmq.ZMQError as exc:  # the context closed under it, or the relay is broken
            if not self._stop.is_set():
                log.warning("KV-event relay stopped: %s; kv_aware routes without events", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close()

    def _close(self) -> None:
        for sock in self._sockets:
            sock.close(0)
        self._sockets, self._pairs = [], []
        if self._context is not None:
            self._context.term()
            self._context = None
        for source in self.sources:
            if source.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(source.removeprefix("ipc://"))
