"""The loopback address every local service binds, and the Redis probe used while one starts
(HTTP services are probed with :func:`kvtier.httpjson.http_status`)."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def redis_reply(port: int, *, timeout_s: float = 1.0) -> bytes | None:
    """The first line Redis answers to PING (``+PONG``, or ``-NOAUTH ...`` when a password is
    set: both mean it serves); None if nothing answers."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
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
