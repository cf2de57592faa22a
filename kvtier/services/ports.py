"""Free loopback ports for services that several test runs start side by side.

Ports are drawn at random from below the kernel's ephemeral range, so an outgoing connection
(which takes its local port from that range) can never grab one between the check and the
service's own bind. Each candidate is bound to prove it free; the sockets are held until the
whole set is chosen, so one set never repeats a port. A port handed out once is never handed
out again by this process. Another process can still take one before the service binds it:
services retry their start with fresh ports when the bind fails (``Service.start``).
"""

from __future__ import annotations

import random
import socket
import threading
from contextlib import ExitStack
from pathlib import Path

from kvtier.errors import ServiceStartError

HOST = "127.0.0.1"
_LOWEST = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

_lock = threading.Lock()
_handed_out: set[int] = set()
_rng = random.SystemRandom()


def pick_ports(count: int, *, attempts: int = 200) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that were free a moment ago."""
    low, high = _candidate_range()
    with _lock, ExitStack() as held:
        chosen: list[int] = []
        for _ in range(attempts):
            if len(chosen) == count:
                break
            port = _rng.randint(low, high) if low <= high else 0
            if port in _handed_out or port in chosen:
                continue
            sock = _try_bind(port)
            if sock is not None:
                held.enter_context(sock)
                port = sock.getsockname()[1]
                if port not in _handed_out and port not in chosen:
                    chosen.append(port)
        if len(chosen) < count:
            raise ServiceStartError(
                f"found only {len(chosen)} of {count} free ports in {low}-{high} on {HOST}")
        _handed_out.update(chosen)
        return chosen


def _candidate_range() -> tuple[int, int]:
    """Ports below the ephemeral range (32768 by default), else above it; an empty range
    (low > high) when neither has room, and then the kernel picks (port 0)."""
    try:
        first, last = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        first, last = 32768, 60999
    if first - 1 - _LOWEST >= 2000:
        return _LOWEST, first - 1
    if 65535 - last >= 2000:
        return last + 1, 65535
    return 1, 0


def _try_bind(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        return None
    return sock


def port_in_use(port: int) -> bool:
    """True if something already listens on (or holds) ``port`` on 127.0.0.1."""
    sock = _try_bind(port)
    if sock is None:
        return True
    sock.close()
    return False
