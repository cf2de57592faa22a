"""The loopback address local services bind unless given a host's own, and the Redis probe used
while one starts (HTTP services are probed with :func:`kvtier.httpjson.http_status`)."""

from __future__ import annotations

import ipaddress
import socket

from kvtier.errors import ConfigError

HOST = "127.0.0.1"


def check_host(host: str) -> str:
    """``host`` if it is one IPv4 address a service can bind and clients can reach: not a
    wildcard (a service binds one address, never all interfaces)."""
    try:
        address = ipaddress.IPv4Address(host)
    except ValueError:
        raise ConfigError(f"host: expected an IPv4 address (like 127.0.0.1); got {host!r}"
                          ) from None
    if address.is_unspecified or address.is_multicast:
        raise ConfigError(f"host: {host} is not one address; give the address to bind")
    return host


def redis_reply(port: int, *, host: str = HOST, timeout_s: float = 1.0) -> bytes | None:
    """The first line Redis answers to PING (``+PONG``, or ``-NOAUTH ...`` when a password is
    set: both mean it serves); None if nothing answers."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                data = sock.recv(256)
                if not data:
                    return None
                reply += data
            return reply.strip()
    except OSError:
        return None
