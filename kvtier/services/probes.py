"""Quick "does it answer?" probes used while a service starts (standard library only)."""

from __future__ import annotations

import http.client
import socket

from kvtier.services.ports import HOST


def http_status(port: int, path: str = "/", *, method: str = "GET",
                timeout_s: float = 1.0) -> int | None:
    """The HTTP status that ``HOST:port`` answers for ``path``; None if nothing answers."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


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
