"""KvtierClient against an embedded server: the two-phase store and load through the
shared-memory arena, rejected requests, and a server that is missing or restarts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from store_helpers import (
    NS,
    PAYLOAD,
    SLOT_BYTES,
    TOKENS,
    MakeServer,
    client_load,
    client_store,
    expected,
    keys,
    pattern,
    server_config,
    stalled,
    store_of,
)

from kvtier.client import KvtierClient
from kvtier.codec import HEADER_SIZE
from kvtier.errors import RequestRejected, ServerUnavailable
from kvtier.keys import ChunkKey
from kvtier.server import NodeServer
from kvtier.tiers.arena import Arena, default_name, shm_path


def test_hello_describes_the_arena(server: NodeServer, client: KvtierClient) -> None:
    hello = client.connect()
    assert hello.arena_name == server.arena_name
    assert (hello.num_slots, hello.slot_bytes, hello.header_size) == (8, 8192, HEADER_SIZE)
    assert hello.lease_ttl_s == 30.0
    assert client.connected


def test_a_round_trip_through_the_arena(server: NodeServer, client: KvtierClient) -> None:
    k = keys(3)
    slots = client_store(client, k, fill=5)
    assert None not in slots
    arena = store_of(server).arena.array
    for key, slot in zip(k, slots, strict=True):
        assert slot is not None
        assert arena[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD].tobytes() == \
            pattern(key, 5).tobytes(), "payload_view writes straight into the server's arena"
    assert client.lookup(k) == ["arena"] * 3
    assert client_load(client, k) == expected(k, fill=5)
    miss = client.lease(keys(1, "missing"))
    assert (miss.slots, miss.tiers, miss.ready) == ([], [], True)
    client.release(miss.lease_id)
    store_of(server).check_integrity()


def test_reserve_then_abort(server: NodeServer, client: KvtierClient) -> None:
    k = keys(2)
    slots = client.reserve(NS, k, payload_len=PAYLOAD, tokens=TOKENS)
    assert None not in slots
    assert client.lookup(k) == []
    assert client.reserve(NS, k, payload_len=PAYLOAD, tokens=TOKENS) == [None, None]
    assert client.abort(k) == 2
    assert store_of(server).arena.free_slots == 8
    assert client.commit(k) == 0
    store_of(server).check_integrity()


def test_bad_requests_are_rejected_and_nothing_stored_is_lost(
        server: NodeServer, client: KvtierClient) -> None:
    k = keys(2)
    client_store(client, k)
    short = ChunkKey(b"short")
    rejected = [
        (lambda: client.lookup([k[0], short]), r"keys\[1\]: expected bytes of length >= 32"),
        (lambda: client.lease([short]), r"keys\[0\]: expected bytes of length >= 32"),
        (lambda: client.commit([short]), r"keys\[0\]: expected bytes of length >= 32"),
        (lambda: client.reserve(NS, [keys(1, "new")[0], short], payload_len=PAYLOAD,
                                tokens=TOKENS), r"keys\[1\]: expected bytes of length >= 32"),
        (lambda: client.release(999), "no open lease 999"),
        (lambda: client.wait(999, 0.1), "no open lease 999"),
        (lambda: client.reserve(NS, keys(1, "new"), payload_len=PAYLOAD, tokens=TOKENS,
                                priority=101), "priority: expected int <= 100"),
        (lambda: client.set_priority(k, 101), "priority: expected int <= 100"),
        (lambda: client.set_priority(k, 80, retain_s=0), r"retain_s: expected float > 0.0"),
        (lambda: client.set_priority(k, 80, retain_s=float("nan")),
         r"retain_s: expected float > 0.0"),
        (lambda: client.set_priority(k, 80, retain_s=1e9), r"retain_s: expected float <= 86400"),
        (lambda: client.reserve(NS, keys(1, "new"), payload_len=PAYLOAD, tokens=TOKENS,
                                priority=80, retain_s=-1.0), r"retain_s: expected float > 0.0"),
        (lambda: client.lease([k[0], k[1], k[0]]), r"keys\[2\] repeats keys\[0\]"),
        (lambda: client.lookup([k[1], k[1]]), r"keys\[1\] repeats keys\[0\]"),
        (lambda: client.commit([k[1], k[1]]), r"keys\[1\] repeats keys\[0\]"),
        (lambda: client.wait(999, float("nan")), "timeout_s must be a finite number"),
        (lambda: client.wait(999, -1.0), "timeout_s must be a finite number"),
        (lambda: client.reserve(NS, keys(1, "new"), payload_len=8192, tokens=TOKENS),
         "payload_len 8192 does not fit an arena slot of 8192 bytes"),
    ]
    for call, message in rejected:
        with pytest.raises(RequestRejected, match=f"bad_request: {message}"):
            call()
        assert client.connected, "a rejected request keeps the connection"
    store = store_of(server)
    assert store.arena.free_slots == 6, "nothing was reserved by the rejected requests"
    assert client.lookup(k) == ["arena", "arena"]
    assert client_load(client, k) == expected(k)
    store.check_integrity()


def test_no_server_means_server_unavailable(tmp_path: Path) -> None:
    client = KvtierClient(str(tmp_path / "nobody.sock"), timeout_s=1.0)
    with pytest.raises(ServerUnavailable, match="not reachable"):
        client.lookup(keys(1))
    with pytest.raises(ServerUnavailable):
        client.connect()
    assert not client.connected
    client.close()


def test_the_client_reconnects_to_a_restarted_server(make_server: MakeServer) -> None:
    first = make_server()
    client = KvtierClient(first.socket_path)
    k = keys(2)
    client_store(client, k, fill=1)
    old_arena = client.arena.name
    first.stop()
    with pytest.raises(ServerUnavailable):
        client.lookup(k)  # the connection died with the server
    with pytest.raises(ServerUnavailable):
        client.lookup(k)  # and nobody listens until it is back
    assert not client.connected

    second = make_server()
    assert second.socket_path == first.socket_path and second.arena_name != old_arena
    assert client.lookup(k) == [], "a new server, a new (empty) arena"
    assert client.arena.name == second.arena_name, "the client mapped the new arena"
    client_store(client, k, fill=2)
    assert client_load(client, k) == expected(k, fill=2)
    arena = store_of(second).arena.array
    slot = client.lease(k[:1]).slots[0]
    assert arena[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD].tobytes() == expected(k[:1], 2)[0]
    client.close()
    store_of(second).check_integrity()


def test_one_client_shared_by_threads(server: NodeServer, client: KvtierClient) -> None:
    failures: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            mine = keys(2, f"thread{n}-")
            for _ in range(10):
                client_store(client, mine, fill=n)
                assert client_load(client, mine) == expected(mine, fill=n)
        except BaseException as exc:  # handed to the main thread below
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failures == []
    assert client.lookup([key for n in range(4) for key in keys(2, f"thread{n}-")]) \
        == ["arena"] * 8
    store_of(server).check_integrity()


def test_wait_and_poll_follow_a_load_from_disk(make_server: MakeServer) -> None:
    server = make_server(slots=2, disk_bytes=1 << 20)
    store = store_of(server)
    k = keys(1)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
        assert store.flush()
        client_store(client, keys(2, "filler"))
        assert store.flush()
        assert client.lookup(k) == ["disk"]
        with stalled(store.tiers[0].pool, store.tiers[0].config.io_threads):
            lease = client.lease(k)
            assert (lease.tiers, lease.ready) == (["disk"], False)
            status = client.poll(lease.lease_id)
            assert (status.ready, status.failed, status.done) == ([False], [False], False)
        status = client.wait(lease.lease_id, 5.0)
        assert (status.ready, status.failed, status.done) == ([True], [False], True)
        assert client.payload_view(lease.slots[0], PAYLOAD).tobytes() == expected(k)[0]
        client.release(lease.lease_id)
        assert client.lookup(k) == ["arena"]
    store.check_integrity()


def test_a_timed_retention_travels_over_the_socket(make_server: MakeServer) -> None:
    server = make_server(slots=4)
    k = keys(2)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
        client.set_priority(k, 90, retain_s=45.0)
        policy = store_of(server).index.policy
        retention = policy.retention(k[0])
        assert retention is not None and retention[0] == 90 and retention[1] is not None
        assert policy.order()[-2:] == k[::-1]  # the head most recent: tail first still
        client.set_priority(k, 0)  # a release
        assert policy.order()[:2] == k[::-1] and policy.retention(k[0]) == (0, None)


def test_set_priority_keeps_a_chunk_in_the_arena(make_server: MakeServer) -> None:
    server = make_server(slots=2)
    k = keys(1)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
        client.set_priority(k, 90)
        for n in range(3):
            client_store(client, keys(1, f"other{n}"))
        assert client.lookup(k) == ["arena"]
        assert client.lookup(keys(1, "other0")) == []
    store_of(server).check_integrity()


def test_payload_view_is_a_window_on_the_slot(server: NodeServer, client: KvtierClient
                                              ) -> None:
    (slot,) = client.reserve(NS, keys(1), payload_len=PAYLOAD, tokens=TOKENS)
    assert slot is not None
    view = client.payload_view(slot, PAYLOAD)
    assert view.shape == (PAYLOAD,) and view.dtype == np.uint8
    view[:] = 7
    assert (store_of(server).arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD] == 7).all()
    client.abort(keys(1))


def test_a_restart_under_a_fixed_arena_name_is_noticed(tmp_path: Path) -> None:
    """Scenario: the arena name is fixed in the config, the server restarts; the client must
    map the new arena, not keep the old mapping of a file that was unlinked."""
    name = f"kvtier-fixed-{os.getpid()}"
    config = server_config(tmp_path, arena={"size_bytes": 4 * SLOT_BYTES,
                                            "slot_bytes": SLOT_BYTES, "name": name})
    with NodeServer(config) as first:
        client = KvtierClient(first.socket_path)
        old = client.arena
        first_instance = client.connect().instance
    with NodeServer(config):
        assert client.connect(refresh=True).instance != first_instance
        assert client.arena is not old
        k = keys(1)
        client_store(client, k)
        assert client_load(client, k) == expected(k)
    client.close()


def test_a_server_removes_arenas_left_by_dead_servers(make_server: MakeServer) -> None:
    dead = subprocess.run(  # exits without unlinking, as a server killed with SIGKILL does
        [sys.executable, "-c", "import os\nfrom kvtier.tiers.arena import Arena, default_name\n"
         f"print(Arena(default_name(), 2, {SLOT_BYTES}, prefault=False).name, flush=True)\n"
         "os._exit(0)\n"], capture_output=True, text=True, check=True, timeout=30)
    stale = dead.stdout.strip()
    mine = Arena(default_name(), 2, SLOT_BYTES, prefault=False)
    try:
        assert os.path.exists(shm_path(stale))
        make_server()
        assert not os.path.exists(shm_path(stale))
        assert os.path.exists(shm_path(mine.name))  # its owner holds its lock: kept
    finally:
        mine.close()
        mine.unlink()


def test_engine_counters_reach_the_servers_metrics(server: NodeServer,
                                                   client: KvtierClient) -> None:
    assert client.report("vllm-abc", {"loaded_tokens|arena": 512, "stored_chunks": 3}) == 2
    registry = server.metrics.registry
    sample = registry.get_sample_value
    labels = {"client": "vllm-abc", "event": "loaded_tokens", "tier": "arena"}
    assert sample("kvtier_engine_events_total", labels) == 512
    with pytest.raises(RequestRejected, match="not a name"):
        client.report("vllm abc; drop", {"stored_chunks": 1})
    with pytest.raises(RequestRejected, match="non-negative"):
        client.report("vllm-abc", {"stored_chunks": 1, "loaded_tokens|disk": -5})
    stored = {"client": "vllm-abc", "event": "stored_chunks", "tier": ""}
    assert sample("kvtier_engine_events_total", stored) == 3  # all or nothing
