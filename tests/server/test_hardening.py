"""The server against clients that skip the handshake, stall mid-message, crowd it, flood
its metrics, drop their connection mid two-phase operation, or hit a server bug."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from store_helpers import (
    NS,
    PAYLOAD,
    TOKENS,
    MakeServer,
    client_store,
    keys,
    sample,
    store_of,
    wait_until,
)

from kvtier.client import KvtierClient
from kvtier.errors import RequestRejected, ServerUnavailable
from kvtier.protocol import Error, Hello, Lookup, decode_reply, encode, read_frame
from kvtier.server import NodeServer


def connect(server: NodeServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(server.socket_path)
    return sock


def answer(sock: socket.socket) -> object:
    body = read_frame(sock, 1 << 20)
    assert body is not None
    return decode_reply(body)


def hung_up(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def drop_connection(client: KvtierClient) -> None:
    """What a socket timeout does: the client drops its connection (and reconnects later)."""
    assert client._sock is not None
    client._drop()


# ---------------------------------------------------------------------- the handshake

def test_a_connection_must_start_with_a_hello(server: NodeServer) -> None:
    with connect(server) as sock:
        sock.sendall(encode(Lookup(keys(1))))
        error = answer(sock)
        assert isinstance(error, Error) and error.code == "protocol"
        assert "first message must be a hello" in error.message
        assert hung_up(sock)


def test_a_refused_hello_closes_the_connection(server: NodeServer) -> None:
    with connect(server) as sock:
        sock.sendall(encode(Hello("old", os.getpid(), version=1)))
        error = answer(sock)
        assert isinstance(error, Error) and error.code == "version"
        assert "protocol 1" in error.message
        assert hung_up(sock), "no lookup is ever answered on a refused connection"


# ---------------------------------------------------------------------- server limits

def test_clients_that_stall_mid_message_are_cut_off(make_server: MakeServer) -> None:
    server = make_server(frame_timeout_s=0.5)
    stallers = []
    for i in range(50):
        sock = connect(server)
        if i % 3:
            sock.sendall(encode(Hello("staller", os.getpid())))
            answer(sock)
            frame = encode(Lookup(keys(4)))
            sock.sendall(frame[: 2 + i % 20])  # half a length prefix, or half a body
        # i % 3 == 0: never even says hello
        stallers.append(sock)
    assert wait_until(lambda: sample(server, "kvtier_clients") == 0, 15.0), \
        "every stalled client was disconnected"
    for sock in stallers:
        assert hung_up(sock)
        sock.close()
    with KvtierClient(server.socket_path) as client:  # and the server still serves
        client_store(client, keys(1))
        assert client.lookup(keys(1)) == ["arena"]


def test_an_idle_client_keeps_its_connection(make_server: MakeServer) -> None:
    server = make_server(frame_timeout_s=0.3)
    with KvtierClient(server.socket_path) as client:
        client.lookup(keys(1))
        time.sleep(0.8)  # idle between messages: fine
        assert client.lookup(keys(1)) == []
        assert sample(server, "kvtier_protocol_errors_total") == 0


def test_connections_beyond_the_cap_are_refused(make_server: MakeServer) -> None:
    server = make_server(max_clients=3)
    held = [KvtierClient(server.socket_path, name=f"c{i}") for i in range(3)]
    for client in held:
        client.lookup(keys(1))
    extra = KvtierClient(server.socket_path, name="extra")
    with pytest.raises(ServerUnavailable, match="at most 3 connections"):
        extra.lookup(keys(1))
    held.pop().close()
    assert wait_until(lambda: sample(server, "kvtier_clients") == 2, 15.0)
    assert extra.lookup(keys(1)) == []
    for client in [*held, extra]:
        client.close()


def test_reported_series_are_capped_and_nothing_is_half_added(make_server: MakeServer) -> None:
    server = make_server(max_report_series=3)
    with KvtierClient(server.socket_path) as client:
        assert client.report("engine", {"hits": 1, "loaded|arena": 2}) == 2
        with pytest.raises(RequestRejected, match="at most 3 reported series"):
            client.report("engine", {"hits": 1, "a": 1, "b": 1})
        assert sample(server, "kvtier_engine_events_total", client="engine", event="hits",
                      tier="") == 1, "all or nothing"
        assert client.report("engine", {"hits": 1, "c": 1}) == 2
        with pytest.raises(RequestRejected):
            client.report("other-engine", {"hits": 1})
        assert sample(server, "kvtier_engine_events_total", client="engine", event="hits",
                      tier="") == 2


def test_a_nan_wait_is_a_documented_error(client: KvtierClient) -> None:
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(RequestRejected) as info:
            client.wait(1, bad)
        assert info.value.code == "bad_request"


# ---------------------------------------------------------------------- sessions

def test_a_reconnecting_client_keeps_what_it_owns(make_server: MakeServer) -> None:
    server = make_server(orphan_grace_s=5.0)
    store = store_of(server)
    k = keys(2)
    with KvtierClient(server.socket_path) as client, \
            KvtierClient(server.socket_path, name="other") as other:
        other.connect()
        client_store(client, k[:1])
        lease = client.lease(k[:1])
        slots = client.reserve(NS, k[1:], payload_len=PAYLOAD, tokens=TOKENS)
        assert None not in slots
        drop_connection(client)
        assert wait_until(lambda: sample(server, "kvtier_clients") == 1, 15.0)
        assert other.commit(k[1:]) == 0, "another client's reservation"
        assert client.commit(k[1:]) == 1, "reconnected: still the owner"
        client.release(lease.lease_id)
        assert client.lookup(k) == ["arena", "arena"]
    store.check_integrity()


def test_a_client_gone_past_the_grace_loses_what_it_held(make_server: MakeServer) -> None:
    server = make_server(orphan_grace_s=0.2)
    store = store_of(server)
    k = keys(1)
    with KvtierClient(server.socket_path) as client:
        assert None not in client.reserve(NS, k, payload_len=PAYLOAD, tokens=TOKENS)
        drop_connection(client)
        assert wait_until(lambda: len(store.reservations) == 0, 15.0)
        assert client.commit(k) == 0
    store.check_integrity()


# ---------------------------------------------------------------------- server bugs

def test_an_internal_error_is_told_apart_from_a_bad_request(
        server: NodeServer, client: KvtierClient, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_of(server)
    k = keys(1)
    client_store(client, k)

    def buggy(*_args: object) -> None:
        raise KeyError("a bug in the store")

    monkeypatch.setattr(store, "lookup_hit", buggy)
    with pytest.raises(RequestRejected) as info:
        client.lookup(k)
    assert info.value.code == "internal" and "a bug in the store" in str(info.value)
    assert sample(server, "kvtier_internal_errors_total", op="lookup") == 1
    monkeypatch.undo()
    assert client.lookup(k) == ["arena"], "the same connection goes on"
    with pytest.raises(RequestRejected) as info:
        client.release(12345)
    assert info.value.code == "bad_request"
    store.check_integrity()


def test_a_frame_cut_in_half_then_closed_leaves_no_trace(make_server: MakeServer) -> None:
    server = make_server(orphan_grace_s=0.0)
    store = store_of(server)
    with connect(server) as sock:
        sock.sendall(encode(Hello("raw", os.getpid())))
        answer(sock)
        sock.sendall(struct.pack("<I", 64) + b"\x81" * 10)
    assert wait_until(lambda: sample(server, "kvtier_clients") == 0, 15.0)
    assert len(store.leases) == 0
    store.check_integrity()


def test_a_client_gone_before_the_hello_reply_does_not_hold_its_session(
        make_server: MakeServer) -> None:
    server = make_server(orphan_grace_s=60.0)  # sessions stay listed while we look
    tokens = [f"{i:08x}" for i in range(40)]
    for token in tokens:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(server.socket_path)
        sock.sendall(encode(Hello("gone", os.getpid(), session=token)))
        sock.close()  # before the server replies: its reply meets a closed socket
    assert server.sessions is not None
    sessions = server.sessions

    def all_detached() -> bool:
        with sessions._lock:
            held = [sessions._by_token[t].connections for t in tokens if t in sessions._by_token]
        return len(held) == len(tokens) and not any(held)
    assert wait_until(lambda: sample(server, "kvtier_clients") == 0, 5.0)
    assert wait_until(all_detached, 5.0), "every session's connection count is back to 0"


def test_a_client_trickling_a_message_is_cut_off_after_frame_timeout(
        make_server: MakeServer) -> None:
    server = make_server(frame_timeout_s=0.5)
    with connect(server) as sock:
        sock.sendall(encode(Hello("trickler", os.getpid())))
        answer(sock)
        frame = encode(Lookup(keys(4)))
        start = time.monotonic()
        for byte in frame:  # one byte per 0.2 s: each recv is quick, the whole is not
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - start > 3.0:
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - start
        assert elapsed < 2.0, f"still connected after {elapsed:.1f} s of trickling"
        assert hung_up(sock)
