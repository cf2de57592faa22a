"""The node server: a unix control socket, the store, housekeeping and /metrics.

One runs per node (``kvtier server --config FILE``) or inside another process as threads
(:class:`NodeServer` ``.start()``, the embedded mode used by single-engine setups and tests).
The socket and its folder are owner-only; the arena is a 0600 shared-memory file.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import threading
import time
from typing import Any

from kvtier import address
from kvtier.address import advertised_host, check_exposure
from kvtier.auth import read_secrets
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError, ProtocolError
from kvtier.metrics import StoreMetrics
from kvtier.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    InvalidMessage,
    Reply,
    decode_request,
    encode,
    read_frame,
)
from kvtier.server.http import NodeHTTP
from kvtier.server.service import Caller, Service
from kvtier.server.sessions import Sessions
from kvtier.store import TieredStore
from kvtier.tiers import arena

log = logging.getLogger("kvtier.server")
HOUSEKEEPING_S = 0.5
REFUSING = 16
MIN_TOKEN_BYTES = 16
"""Shorter HTTP tokens are accepted with a warning."""


class NodeServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.socket_path = config.socket_path
        self.metrics = StoreMetrics()
        self.arena_name = config.arena.name or arena.default_name()
        self.store: TieredStore | None = None
        self.service: Service | None = None
        self.sessions: Sessions | None = None
        self.metrics_port: int | None = None
        self._listener: socket.socket | None = None
        self._conns: dict[int, socket.socket] = {}
        self._conn_ids = itertools.count(1)
        self._stop = threading.Event()
        self._refusing = threading.BoundedSemaphore(REFUSING)
        self._threads: list[threading.Thread] = []
        self._http: NodeHTTP | None = None
        self.http_url: str | None = None
        """The HTTP API's advertised URL (``http://metrics_advertise_host:PORT``) once
        started; None without ``metrics_port``."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> NodeServer:
        """Bind, build the store, index lower tiers and start serving in threads."""
        tokens = http_tokens(self.config)  # a bad token source or exposure fails first
        check_exposure(self.config, bool(tokens))
        self._listener = self._bind()
        for name in arena.sweep_stale():
            log.warning("removed arena %s left by a server that died", name)
        try:
            self.store = TieredStore(self.config, arena_name=self.arena_name,
                                     metrics=self.metrics)
            self.store.rebuild()
            self.service = Service(self.store, self.config.access_log,
                                   self.config.max_report_series)
            self.sessions = Sessions(self.store, self.config.orphan_grace_s)
            self._start_metrics(tokens)
        except BaseException:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            if self.store is not None:
                self.store.close(drain_s=0)
            raise
        self._spawn(self._accept_loop, "kvtier-accept")
        self._spawn(self._housekeeping, "kvtier-housekeeping")
        log.info("kvtier server listening on %s, arena %s (%d slots of %d bytes)",
                 self.socket_path, self.arena_name, self.config.arena.num_slots,
                 self.config.arena.slot_bytes)
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until stop() is called; True if it was."""
        return self._stop.wait(timeout_s)

    def stop(self, drain_s: float = 10.0) -> None:
        """Stop accepting, disconnect clients, drain writes in flight, free the arena."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)
        if self._http is not None:
            self._http.stop()
        if self.service is not None:
            self.service.close()
        if self.store is not None:
            self.store.close(drain_s)
        log.info("kvtier server stopped")

    def __enter__(self) -> NodeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ socket

    def _bind(self) -> socket.socket:
        folder = os.path.dirname(os.path.abspath(self.socket_path))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _check_private(folder)
        if os.path.lexists(self.socket_path):
            if not stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                raise ConfigError(f"socket_path {self.socket_path}: exists and is not a socket")
            if _is_live(self.socket_path):
                raise ConfigError(f"socket_path {self.socket_path}: a server is already "
                                  "listening there")
            os.unlink(self.socket_path)  # left by a server that died
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(self.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        listener.listen(64)
        return listener

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set():
                    break
                log.warning("accept failed (%s); retrying", exc)  # e.g. out of descriptors
                time.sleep(0.1)
                continue
            if len(self._conns) >= self.config.max_clients:
                self._refuse(conn, Error("busy", f"the server serves at most "
                                                 f"{self.config.max_clients} connections"))
                continue
            conn_id = next(self._conn_ids)
            self._conns[conn_id] = conn
            self.metrics.clients.set(len(self._conns))
            threading.Thread(target=self._serve, args=(conn, conn_id), daemon=True,
                             name=f"kvtier-conn-{conn_id}").start()

    def _refuse(self, conn: socket.socket, error: Error) -> None:
        """Answer a connection over the cap with ``error`` and close it, without holding up
        the accept loop: the refusal reads the client's hello first (briefly), so the client
        sees the error, not a reset. At most REFUSING refusals at once; beyond, just close."""
        self.metrics.protocol_errors.inc()
        if not self._refusing.acquire(blocking=False):
            conn.close()
            return

        def refuse() -> None:
            try:
                with contextlib.suppress(OSError, ProtocolError):
                    conn.settimeout(1.0)
                    read_frame(conn, self.config.max_message_bytes)
                    conn.sendall(encode(error))
            finally:
                conn.close()
                self._refusing.release()

        threading.Thread(target=refuse, daemon=True, name="kvtier-refuse").start()

    def _serve(self, conn: socket.socket, conn_id: int) -> None:
        assert self.service is not None and self.sessions is not None
        caller: Caller | None = None
        try:
            caller = self._handshake(conn, conn_id)
            if caller is not None:
                self._converse(conn, conn_id, caller)
        except ProtocolError as exc:
            self.metrics.protocol_errors.inc()
            log.warning("client %d sent a bad message, disconnecting: %s", conn_id, exc)
            with contextlib.suppress(OSError):
                conn.sendall(encode(Error("protocol", str(exc))))
        except TimeoutError:
            log.info("client %d: a message was not completed within %g s; disconnecting",
                     conn_id, self.config.frame_timeout_s)
        except OSError:
            pass  # the client went away mid-message; its session ends below
        finally:
            self._conns.pop(conn_id, None)
            self.metrics.clients.set(len(self._conns))
            if caller is not None:
                self.sessions.detach(caller.session, caller.owner)
            conn.close()

    def _handshake(self, conn: socket.socket, conn_id: int) -> Caller | None:
        """The first message must be a hello this server accepts; otherwise the connection
        gets an error and is closed (returns None)."""
        assert self.service is not None and self.sessions is not None
        conn.settimeout(self.config.frame_timeout_s)  # the hello comes promptly, or never
        body = read_frame(conn, self.config.max_message_bytes,
                          frame_timeout_s=self.config.frame_timeout_s)
        if body is None:
            return None
        try:
            hello = decode_request(body)
        except InvalidMessage as exc:
            raise ProtocolError(str(exc)) from exc
        if not isinstance(hello, Hello):
            raise ProtocolError(f"the first message must be a hello, not "
                                f"{type(hello).__name__.lower()}")
        if hello.version != PROTOCOL_VERSION:
            self.metrics.protocol_errors.inc()
            conn.sendall(encode(Error("version", f"client speaks protocol {hello.version}, "
                                                 f"this server speaks {PROTOCOL_VERSION}: "
                                                 "upgrade one of them")))
            return None
        owner = self.sessions.attach(hello.session)
        try:
            conn.settimeout(None)  # between messages a client may be idle as long as it likes
            conn.sendall(encode(self.service.hello()))
        except BaseException:  # the client went before the reply: the session is not held
            self.sessions.detach(hello.session, owner)
            raise
        return Caller(owner, hello.session)

    def _converse(self, conn: socket.socket, conn_id: int, caller: Caller) -> None:
        assert self.service is not None
        limit, timeout = self.config.max_message_bytes, self.config.frame_timeout_s
        while not self._stop.is_set():
            body = read_frame(conn, limit, frame_timeout_s=timeout)
            if body is None:
                return
            reply: Reply
            try:
                request = decode_request(body)
            except InvalidMessage as exc:
                reply = Error("bad_request", str(exc))
            else:
                reply = self.service.handle(caller, request)
            conn.settimeout(timeout)  # a client that does not read its replies is cut off
            conn.sendall(encode(reply))
            conn.settimeout(None)

    # ------------------------------------------------------------------ background

    def _housekeeping(self) -> None:
        assert self.store is not None
        while not self._stop.wait(HOUSEKEEPING_S):
            try:
                self.store.housekeeping()
                if self.sessions is not None:
                    self.sessions.forget_idle()
            except Exception:  # keep the server alive; the next round retries
                log.exception("housekeeping failed")

    def _start_metrics(self, tokens: list[bytes]) -> None:
        if self.config.metrics_port is None:
            return
        assert self.service is not None
        auth = self.config.auth
        advertised = advertised_host(self.config)
        self._http = NodeHTTP(self.service, self.config.metrics_host, self.config.metrics_port,
                              deadline_s=max(self.config.frame_timeout_s, 1.0), tokens=tokens,
                              metrics_need_token=auth.metrics_need_token)
        self.metrics_port = self._http.port
        self.http_url = self._http.url = address.url(advertised, self.metrics_port)
        self._http.start()
        guarded = ", ".join(sorted(self._http.protected))
        log.info("metrics and lookups bound on %s port %d, advertised as %s "
                 "(/metrics, /v1/lookup); %s",
                 self.config.metrics_host, self.metrics_port, self.http_url,
                 f"{guarded} need the bearer token" if tokens else
                 f"no token set ({auth.http_token_env} / auth.http_token_file): "
                 f"{guarded} answer anyone who reaches it")

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)


def http_tokens(config: ServerConfig) -> list[bytes]:
    """The bearer tokens the HTTP API accepts (every entry of its variable or file: two while
    one is rotated), ``[]`` when none is set. A ConfigError names the source, never a token."""
    auth = config.auth
    tokens = read_secrets(auth.http_token_env, auth.http_token_file, what="node HTTP token")
    for i, token in enumerate(tokens, 1):
        if len(token) < MIN_TOKEN_BYTES:
            log.warning("node HTTP token %d of %d is %d bytes; use at least %d random ones "
                        "(it is all that keeps others from asking which prompts are cached)",
                        i, len(tokens), len(token), MIN_TOKEN_BYTES)
    return tokens


def _check_private(folder: str) -> None:
    """The socket's folder must be ours and closed to others: whoever can write there can
    put a socket of their own in our server's place."""
    info = os.lstat(folder)
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ConfigError(f"socket folder {folder} must be owned by uid {os.getuid()} and not "
                          f"writable by group or others (it is uid {info.st_uid}, mode "
                          f"{stat.filemode(info.st_mode)})")


def _is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


EmbeddedServer = NodeServer
"""The same server, started inside another process with ``.start()``."""
