"""TCP ports for the servers kvtier starts: free ones, distinct ones, and checking a plan.

A port is free when a server could bind it now (``SO_REUSEADDR``, as the servers set). Ports
chosen together are held open until all are chosen, so they are distinct; a plan of derived
ports (``P``, ``P+1+i``, ``P+101+i``) is checked before anything starts, each one named.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable, Mapping

from kvtier.errors import ConfigError

MAX_PORT = 65535
_ATTEMPTS = 50


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free now (each socket stays bound until all are picked)."""
    with contextlib.ExitStack() as held:
        out = []
        for _ in range(n):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            out.append(int(s.getsockname()[1]))
        return out


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def free_base(offsets: Iterable[int], host: str = "127.0.0.1") -> int:
    """A port ``P`` such that every ``P + offset`` is free and at most 65535."""
    offsets = sorted(set(offsets))
    for _ in range(_ATTEMPTS):
        base = free_port(host)
        if base + offsets[-1] <= MAX_PORT and all(port_free(base + k, host) for k in offsets):
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
