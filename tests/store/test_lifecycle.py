"""Shutdown and liveness: what a graceful close keeps, and leases of clients that wait."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from store_helpers import (
    NS,
    PAYLOAD,
    SLOT_BYTES,
    TOKENS,
    MakeServer,
    MakeStore,
    build_store,
    expected,
    keys,
    load,
    store_chunks,
)

from kvtier.client import KvtierClient
from kvtier.errors import InvalidRequest, RequestRejected
from kvtier.protocol import Error, Hello, decode_reply, encode, read_frame


def test_close_writes_back_what_only_the_arena_held(tmp_path: Path,
                                                    make_store: MakeStore) -> None:
    """Scenario: write-back keeps chunks in RAM only; a graceful close must not lose them."""
    store = build_store(tmp_path, slots=4, disk_bytes=8 * SLOT_BYTES, write_policy="back")
    k = keys(3)
    store_chunks(store, k)
    store.flush()
    assert store.tiers[0].used == 0  # nothing below yet: write-back waits for eviction
    store.close(drain_s=10)

    again = make_store(tmp_path, slots=4, disk_bytes=8 * SLOT_BYTES, write_policy="back")
    assert again.rebuild() == 3
    assert again.lookup(k) == ["disk"] * 3
    assert load(again, k).payloads == expected(k)
    again.check_integrity()


def test_waiting_renews_a_lease(tmp_path: Path, make_store: MakeStore) -> None:
    now = [0.0]
    store = make_store(tmp_path, slots=4, lease_ttl_s=10.0, clock=lambda: now[0])
    k = keys(1)
    store_chunks(store, k)
    record = store.lease(7, k)
    now[0] = 8.0
    store.wait(record.lease_id, 0.0)  # the client is alive: the deadline moves to 18
    now[0] = 15.0
    store.expire()
    assert record.lease_id in store.leases
    now[0] = 18.5
    store.expire()
    assert record.lease_id not in store.leases
    store.check_integrity()


def test_a_client_of_another_protocol_version_is_refused(make_server: MakeServer) -> None:
    server = make_server()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(server.socket_path)
        sock.sendall(encode(Hello("old", 1, version=999)))
        body = read_frame(sock, 1 << 20)
        assert body is not None
        reply = decode_reply(body)
    assert isinstance(reply, Error)
    assert "protocol 999" in reply.message
    with KvtierClient(server.socket_path) as client:  # the server keeps serving others
        assert client.lookup(keys(1)) == []
    with pytest.raises(RequestRejected):
        KvtierClient(server.socket_path).set_priority(keys(1), 101)


def test_a_dead_clients_slots_are_kept_for_a_grace_period(tmp_path: Path,
                                                          make_store: MakeStore) -> None:
    """Scenario: a scheduler leased a chunk and gave its slot to a worker process, then its
    connection dropped. The worker may still be copying: the slot must not be reused yet."""
    now = [0.0]
    store = make_store(tmp_path, slots=1, orphan_grace_s=5.0, clock=lambda: now[0])
    k = keys(1)
    store_chunks(store, k)
    record = store.lease(7, k)
    store.drop_owner(7)
    assert store.reserve(1, NS, keys(1, "new"), payload_len=PAYLOAD, tokens=TOKENS) == [None]
    now[0] = 5.0
    store.expire()
    assert record.lease_id not in store.leases
    assert store.reserve(1, NS, keys(1, "new"), payload_len=PAYLOAD, tokens=TOKENS) != [None]
    store.check_integrity()


def test_only_the_reserving_client_commits_or_releases(tmp_path: Path,
                                                       make_store: MakeStore) -> None:
    store = make_store(tmp_path, slots=4)
    k = keys(2)
    slots = store.reserve(1, NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert None not in slots
    assert store.commit(k, owner=2) == 0  # not yours
    assert store.abort(k[:1], owner=2) == 0
    assert store.commit(k, owner=1) == 2
    record = store.lease(1, k)
    with pytest.raises(InvalidRequest, match="of this client"):
        store.release(record.lease_id, owner=2)
    store.release(record.lease_id, owner=1)
    store.check_integrity()


@pytest.mark.parametrize("bad", [{"tokens": 0}, {"tokens": 2**32}, {"first_index": -1}])
def test_reserve_refuses_fields_the_chunk_header_cannot_hold(
        tmp_path: Path, make_store: MakeStore, bad: dict[str, int]) -> None:
    store = make_store(tmp_path, slots=2)
    args = {"payload_len": PAYLOAD, "tokens": TOKENS, "first_index": 0} | bad
    with pytest.raises(ValueError, match="tokens"):
        store.reserve(1, NS, keys(1), **args)
    with pytest.raises(ValueError, match="namespace_fp"):
        store.reserve(1, b"short", keys(1), payload_len=PAYLOAD, tokens=TOKENS)
    assert store.arena.free_slots == 2
    store.check_integrity()
