"""The node HTTP API against a caller who names sizes and counts: a body longer than any
lookup needs, more keys than a lookup may hold, keys that are not keys. Each is refused with
its reason before any work, and the API goes on serving (docs/security.md)."""

from __future__ import annotations

import json
import socket

from store_helpers import MakeServer

from kvtier.protocol import MAX_KEYS
from kvtier.server.http import MAX_BODY

from .test_http import fetch


def claimed_post(port: int, length: int) -> tuple[int, bytes]:
    """A POST claiming a body of ``length`` bytes that sends none: (status, answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
                     "\r\n".encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def test_a_body_over_the_cap_is_refused_before_it_is_read(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    assert server.metrics_port
    status, answer = claimed_post(server.metrics_port, 1 << 40)  # a terabyte, never sent
    assert status == 413 and f"body over {MAX_BODY}".encode() in answer
    assert fetch(server.metrics_port, "/healthz")[0] == 200, "and it still serves"


def test_too_many_keys_or_keys_that_are_not_keys_are_refused(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    port = server.metrics_port
    assert port
    many = json.dumps({"keys": ["00" * 32] * (MAX_KEYS + 1)}, separators=(",", ":"))
    status, answer = fetch(port, "/v1/lookup", many.encode())
    assert status == 400 and str(MAX_KEYS) in answer["error"], "more keys than a lookup holds"
    full = json.dumps({"keys": [f"{i:064x}" for i in range(MAX_KEYS)]})  # with ", "
    status, answer = fetch(port, "/v1/lookup", full.encode())
    assert status == 200 and len(answer["tiers"]) <= MAX_KEYS, "the largest lookup fits"
    for bad in (["zz" * 32], ["00" * 31], [7], "00" * 32):
        status, answer = fetch(port, "/v1/lookup", {"keys": bad})
        assert status == 400, bad
    status, answer = fetch(port, "/v1/lookup", {"keys": ["00" * 32]})
    assert status == 200 and len(answer["tiers"]) <= 1, "and it still serves"
