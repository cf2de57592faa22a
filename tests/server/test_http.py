"""The node server's HTTP endpoint: metrics, health, registered namespaces, lookups."""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from store_helpers import NS, MakeServer, client_store, keys, wait_until

from kvtier.client import KvtierClient
from kvtier.protocol import Events, Register
from kvtier.server.http import MAX_CONNECTIONS


def fetch(port: int, path: str, body: Any = None, *,
          headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else
                                      json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     method="POST" if data is not None else "GET",
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            raw = answer.read()
            status = answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, (raw.decode() if path == "/metrics" and status == 200 else json.loads(raw))


def test_lookup_over_http_answers_like_the_socket(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    assert server.metrics_port
    k = keys(3)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k[:2])
        status, doc = fetch(server.metrics_port, "/v1/lookup", {"keys": [x.hex() for x in k]})
        assert status == 200 and doc["tiers"] == client.lookup(k) == ["arena", "arena"]
        assert doc["arrival_s"] == [0.0, 0.0] and doc["instance"] == client.connect().instance
    for bad, why in (({"keys": ["zz" * 32]}, "not hex"), ({"keys": ["ab"]}, "64 hex"),
                     ({"keys": "ab"}, "expected a list"), (b"{not json", "not JSON"),
                     ({"keys": [k[0].hex(), k[0].hex()]}, "repeats")):
        status, doc = fetch(server.metrics_port, "/v1/lookup", bad)
        assert status == 400 and why in doc["error"]
    assert fetch(server.metrics_port, "/nope")[0] == 404


def test_lookups_on_a_kept_alive_connection_do_not_wait_for_a_delayed_ack(
        make_server: MakeServer) -> None:
    """The answer's headers and body are two writes: without TCP_NODELAY the body waits for
    the client's delayed ACK of the headers, ~40 ms a request on a kept-alive connection
    (the router's lookups: 24.6 ms mean measured). A median far below that is the check."""
    server = make_server(metrics_port=0)
    assert server.metrics_port
    body = json.dumps({"keys": [x.hex() for x in keys(16)]})
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=5)
    took = []
    try:
        for _ in range(25):
            start = time.perf_counter()
            conn.request("POST", "/v1/lookup", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            assert answer.status == 200 and json.loads(answer.read())["tiers"] == []
            took.append(time.perf_counter() - start)
    finally:
        conn.close()
    assert statistics.median(took[5:]) < 0.02, took


def test_health_namespaces_and_metrics(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    assert server.metrics_port
    with KvtierClient(server.socket_path) as client:
        client.call(Register(NS, {"model": "m", "chunk_tokens": 256, "tokenizer": "/t"}))
        with pytest.raises(Exception, match="needs 'chunk_tokens'"):
            client.call(Register(NS, {"model": "m"}))
    status, health = fetch(server.metrics_port, "/healthz")
    assert status == 200 and health["ok"] and health["tiers"] == {}
    status, spaces = fetch(server.metrics_port, "/v1/namespaces")
    assert spaces == [{"namespace": NS.hex(), "model": "m", "chunk_tokens": 256,
                       "tokenizer": "/t"}]
    status, text = fetch(server.metrics_port, "/metrics")
    assert status == 200 and "kvtier_lookup_chunks_total" in text


def test_events_report_what_was_stored_and_removed(make_server: MakeServer) -> None:
    server = make_server(slots=2)
    k = keys(3)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k[:2])
        first = client.call(Events(0, NS))
        assert [(op, tier, key) for _seq, op, tier, key in first.events] == \
            [("stored", "arena", k[1]), ("stored", "arena", k[0])]  # committed tail first
        client_store(client, k[2:])  # evicts the least recent
        later = client.call(Events(first.next, NS))
        assert [op for _s, op, _t, _k in later.events] == ["removed", "stored"]
        assert later.events[0][3] == k[1] and not later.lost
        assert client.call(Events(0, b"\x00" * 32)).events == [], "another namespace's"


def raw_post(port: int, length: str) -> tuple[int, bytes]:
    """A POST whose Content-Length header is ``length`` as given; (status, whole answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n"
                     f"\r\n{{}}".encode())
        answer = b""
        while chunk := sock.recv(65536):  # the server closes after a refused length
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def test_a_content_length_that_is_not_a_byte_count_is_refused(
        make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    assert server.metrics_port
    for bad in ("-1", "-100000", "abc", "1e3"):
        status, answer = raw_post(server.metrics_port, bad)
        assert status == 400 and b"not a byte count" in answer, bad
    assert fetch(server.metrics_port, "/healthz")[0] == 200, "and it still serves"


def test_idle_http_connections_are_closed_and_give_way(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0, frame_timeout_s=2.0)
    port = server.metrics_port
    assert port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5)
            for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # all accepted, each holding a handler
        start = time.monotonic()
        assert fetch(port, "/healthz")[0] == 200, "one more takes an idle one's place"
        assert time.monotonic() - start < 1.0
        assert idle[0].recv(1) == b"", "the one that waited longest gave its place up"
        start = time.monotonic()
        assert idle[-1].recv(1) == b"", "an idle connection is closed at its deadline"
        assert time.monotonic() - start < 3.0
    finally:
        for sock in idle:
            sock.close()
    assert wait_until(lambda: fetch(port, "/healthz")[0] == 200, 5.0), "slots free again"
