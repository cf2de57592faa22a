"""TCP ports for the servers kvtier starts: free ones, distinct ones, and checking a plan.

A port is free when a server could bind it now (``SO_REUSEADDR``, as the servers set). Free
ports are drawn at random from below the kernel's ephemeral range (else above it), so an
outgoing connection, which takes its local port from that range, cannot grab one between the
check and the server's own bind, nor leave it in TIME_WAIT. Ports chosen together are held
open until all are chosen, so they are distinct, and a port handed out once is never handed
out again by this process (several test services start side by side). Another process can
still take one before its server binds it: the services retry their start with fresh ports.
A plan of derived ports (``P``, ``P+1+i``, ``P+101+i``) is checked before anything starts,
each one named.

The ephemeral range is ``ip_local_port_range`` (32768-60999 by default); a closed outgoing
connection keeps its port in TIME_WAIT for 60 s, during which no server can bind it,
``SO_REUSEADDR`` or not. A part restarted on a port in that range (a user's ``--port``) can
meet this: :func:`wait_bindable` waits it out, and fails at once only when a server listens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import random
import socket
import threading
import time
from collections.abc import Iterable, Mapping

import psutil

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.ports")

MAX_PORT = 65535
_ATTEMPTS = 50
_LOWEST = 20000
_DRAWS = 200

_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.SystemRandom()


TIME_WAIT_S = 60.0
"""How long Linux keeps a closed connection's port (``TCP_TIMEWAIT_LEN``)."""


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    return _bind_error(port, host) is None


def _bind_error(port: int, host: str) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (32768-60999 if unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def listening(port: int) -> bool:
    """Whether a TCP socket of any process on this host listens on ``port`` (any address)."""
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in psutil.net_connections(kind="tcp"))


def wait_bindable(port: int, what: str, host: str = "127.0.0.1",
                  timeout_s: float = TIME_WAIT_S + 15) -> None:
    """Return once a server could bind ``port``; wait while it is held only by connections
    (an outgoing one's port in TIME_WAIT), raise a ConfigError naming ``what`` at once when a
    server listens there, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        error = _bind_error(port, host)
        if error is None:
            if said:
                log.info("port %d (%s) is free again", port, what)
            return
        if error.errno != errno.EADDRINUSE or listening(port):
            raise ConfigError(f"port {port} ({what}) is in use on {host}: {error.strerror}; "
                              "free it or choose another --port")
        if time.monotonic() >= deadline:
            raise ConfigError(f"port {port} ({what}) stayed in use by connections (no server "
                              f"listens) for {timeout_s:.0f} s; choose a port below "
                              f"{ephemeral_range()[0]}, outside the ephemeral range")
        if not said:
            said = True
            log.warning("port %d (%s) is held by a closed connection (TIME_WAIT: it is in "
                        "the ephemeral range %d-%d); waiting up to %.0f s for it", port, what,
                        *ephemeral_range(), timeout_s)
        time.sleep(0.5)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now, outside the ephemeral range, never handed out before
    by this process (each socket stays bound until all are picked)."""
    low, high = _candidate_range()
    with _lock, contextlib.ExitStack() as held:
        chosen: list[int] = []
        for _ in range(_DRAWS):
            if len(chosen) == n:
                break
            port = _rng.randint(low, high) if low <= high else 0  # 0: the kernel picks
            if port in _handed_out or port in chosen:
                continue
            sock = _bound(port, host)
            if sock is not None:
                held.enter_context(sock)
                port = int(sock.getsockname()[1])
                if port not in _handed_out and port not in chosen:
                    chosen.append(port)
        if len(chosen) < n:
            raise ConfigError(f"found only {len(chosen)} of {n} free ports in {low}-{high} "
                              f"on {host}")
        _handed_out.update(chosen)
        return chosen


def _candidate_range() -> tuple[int, int]:
    """Ports below the ephemeral range, else above it; an empty range (low > high) when
    neither has room for 2000."""
    first, last = ephemeral_range()
    if first - 1 - _LOWEST >= 2000:
        return _LOWEST, first - 1
    if MAX_PORT - last >= 2000:
        return last + 1, MAX_PORT
    return 1, 0


def _bound(port: int, host: str) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_base(offsets: Iterable[int], host: str = "127.0.0.1") -> int:
    """A port ``P`` such that every ``P + offset`` is free, at most 65535 and, as ``P`` is,
    outside the ephemeral range (a part restarted on it never meets a connection's TIME_WAIT)."""
    offsets = sorted(set(offsets))
    first, last = ephemeral_range()
    for _ in range(_ATTEMPTS):
        base = free_port(host)
        ports = [base + k for k in offsets]
        if (ports[-1] <= MAX_PORT and not any(first <= p <= last for p in ports)
                and all(port_free(p, host) for p in ports)):
            return base
    raise ConfigError(f"no free port P with P + each of {offsets} free too, after "
                      f"{_ATTEMPTS} tries")


def check_plan(ports: Mapping[str, int], host: str = "127.0.0.1") -> None:
    """Raise a ConfigError naming the first port of ``ports`` (what it is for -> port) that
    is out of range or in use."""
    for what, port in ports.items():
        if not 1 <= port <= MAX_PORT:
            raise ConfigError(f"port {port} ({what}) is out of range (1-{MAX_PORT}); "
                              "choose a lower --port")
    for what, port in ports.items():
        if not port_free(port, host):
            raise ConfigError(f"port {port} ({what}) is in use on {host}; free it or choose "
                              "another --port")
