"""The node server's HTTP endpoint: metrics, health, registered namespaces, lookups."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from store_helpers import NS, MakeServer, client_store, keys

from kvtier.client import KvtierClient
from kvtier.protocol import Events, Register


def fetch(port: int, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else
                                      json.dumps(body).encode())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                     method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            raw = answer.read()
            status = answer.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    return status, (raw.decode() if path == "/metrics" else json.loads(raw))


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
