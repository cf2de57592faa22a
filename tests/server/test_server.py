"""The node server on a real unix socket: clients that die, race, or send garbage.

Client processes are real subprocesses (the same interpreter running a few lines with
KvtierClient); the server under test runs embedded in this process, so its store can be
inspected directly after each story.
"""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import struct
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from store_helpers import (
    MakeServer,
    client_load,
    client_store,
    expected,
    keys,
    pattern,
    sample,
    server_config,
    store_of,
    wait_until,
)

from kvtier.client import KvtierClient
from kvtier.errors import ConfigError, ServerUnavailable
from kvtier.keys import ChunkKey
from kvtier.protocol import (
    Error,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    Lookup,
    LookupReply,
    decode_reply,
    encode,
    read_frame,
)
from kvtier.server import EmbeddedServer, NodeServer
from kvtier.tiers.arena import shm_path


def run_client(script: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
    """A client process running ``script`` (KvtierClient, the test helpers, json, os, sys)."""
    prelude = ("import os, sys, json\nfrom kvtier.client import KvtierClient\n"
               "from store_helpers import pattern\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.Popen([sys.executable, "-c", prelude + script, *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            stdin=subprocess.PIPE if stdin else None)


def raw_connection(server: NodeServer, *, hello: bool = True, session: str = ""
                   ) -> socket.socket:
    """A bare socket to the server, past the mandatory hello unless ``hello`` is False."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(server.socket_path)
    if hello:
        sock.sendall(encode(Hello("raw", os.getpid(), session=session)))
        body = read_frame(sock, 1 << 20)
        assert body is not None and isinstance(decode_reply(body), HelloReply)
    return sock


# ---------------------------------------------------------------------- the socket

def test_the_socket_is_owner_only(server: NodeServer) -> None:
    mode = os.stat(server.socket_path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(os.stat(shm_path(server.arena_name)).st_mode) == 0o600


def test_a_second_server_on_a_live_socket_fails(tmp_path: Path, server: NodeServer,
                                                client: KvtierClient) -> None:
    second = EmbeddedServer(server_config(tmp_path))
    with pytest.raises(ConfigError, match="a server is already listening"):
        second.start()
    assert not os.path.exists(shm_path(second.arena_name))
    assert os.path.exists(server.socket_path)
    assert client.lookup(keys(1)) == []


def test_a_socket_left_by_a_dead_server_is_replaced(tmp_path: Path,
                                                    make_server: MakeServer) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(tmp_path / "kvtier.sock"))
    dead.close()  # the file stays, nobody listens
    server = make_server()
    with KvtierClient(server.socket_path) as client:
        assert client.connect().arena_name == server.arena_name


def test_stop_disconnects_clients_and_frees_everything(make_server: MakeServer) -> None:
    server = make_server()
    client = KvtierClient(server.socket_path)
    client_store(client, keys(1))
    server.stop()
    assert not os.path.exists(server.socket_path)
    assert not os.path.exists(shm_path(server.arena_name))
    with pytest.raises(ServerUnavailable):
        client.lookup(keys(1))
    client.close()


# ---------------------------------------------------------------------- clients that go away

KILLED_WHILE_HOLDING = """
client = KvtierClient(sys.argv[1])
lease = client.lease([bytes.fromhex(sys.argv[2])])
slots = client.reserve(b"\\0" * 32, [bytes.fromhex(sys.argv[3])], payload_len=100, tokens=16)
client.payload_view(lease.slots[0], 100)  # map the arena, as an engine would
print(json.dumps({"lease": lease.slots, "reserve": slots}), flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_killed_client_loses_its_lease_and_its_reservation(make_server: MakeServer) -> None:
    """After a short grace (a process the client gave slot numbers to may still copy)."""
    server = make_server(slots=2, orphan_grace_s=0.3)
    store = store_of(server)
    held, unfinished = keys(1, "held"), keys(1, "unfinished")
    with KvtierClient(server.socket_path) as client:
        client_store(client, held)
        proc = run_client(KILLED_WHILE_HOLDING, server.socket_path, held[0].hex(),
                          unfinished[0].hex())
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == -9, err
        seen = json.loads(out)
        slot = seen["lease"][0]
        assert seen["reserve"][0] is not None

        assert wait_until(lambda: not store.leases and store.arena.free_slots == 1)
        assert int(store.arena.leases[slot]) == 0
        assert client.lookup(held + unfinished) == ["arena"]
        store.check_integrity()
        assert sample(server, "kvtier_leases_expired_total", kind="lease") == 1
        assert sample(server, "kvtier_leases_expired_total", kind="reservation") == 1

        fresh = keys(2, "fresh")
        assert None not in client_store(client, fresh)  # the leased chunk was evicted for these
        assert client.lookup(held) == []
        assert client_load(client, fresh) == expected(fresh)
    store.check_integrity()


def test_a_lease_left_open_expires_after_its_ttl(make_server: MakeServer) -> None:
    server = make_server(slots=1, lease_ttl_s=0.2)
    store = store_of(server)
    k = keys(1)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
        lease = client.lease(k)
        assert int(store.arena.leases[lease.slots[0]]) == 1
        assert wait_until(lambda: not store.leases)  # housekeeping runs every 0.5 s
        assert int(store.arena.leases[lease.slots[0]]) == 0
        newer = keys(1, "newer")
        assert client_store(client, newer) == [lease.slots[0]], "the slot was reused"
        assert client_load(client, newer) == expected(newer)
    store.check_integrity()


# ---------------------------------------------------------------------- clients that race

RACER = """
client = KvtierClient(sys.argv[1])
client.arena  # connect and map before the start line
print("ready", flush=True)
sys.stdin.readline()
fill, won = int(sys.argv[2]), []
for hexkey in sys.argv[3:]:
    key = bytes.fromhex(hexkey)
    (slot,) = client.reserve(b"\\0" * 32, [key], payload_len=1000, tokens=16)
    if slot is not None:
        client.payload_view(slot, 1000)[:] = pattern(key, fill)
        won.append(key)
if won:
    assert client.commit(won) == len(won)
print(json.dumps([key.hex() for key in won]), flush=True)
"""


def test_concurrent_clients_storing_the_same_keys(make_server: MakeServer) -> None:
    """Four threads and two processes race to store the same 32 keys, each in its own order
    and with its own payload: every key is granted to exactly one, and holds its bytes."""
    server = make_server(slots=48)
    shared = keys(32, "shared")
    winners: dict[int, list[ChunkKey]] = {}
    start = threading.Event()

    def order(fill: int) -> list[ChunkKey]:
        return random.Random(fill).sample(shared, len(shared))

    def racer(fill: int) -> None:
        with KvtierClient(server.socket_path) as client:
            client.connect()
            start.wait(10)
            winners[fill] = [key for key in order(fill)
                             if client_store(client, [key], fill) != [None]]

    procs = [run_client(RACER, server.socket_path, str(fill), *(k.hex() for k in order(fill)),
                        stdin=True)
             for fill in (1, 2)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    threads = [threading.Thread(target=racer, args=(fill,)) for fill in (3, 4, 5, 6)]
    for thread in threads:
        thread.start()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    start.set()
    for thread in threads:
        thread.join(30)
    for fill, proc in zip((1, 2), procs, strict=True):
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        winners[fill] = [ChunkKey(bytes.fromhex(h)) for h in json.loads(out)]

    assert sorted(winners) == [1, 2, 3, 4, 5, 6]
    owner = {key: fill for fill, won in winners.items() for key in won}
    assert sum(len(won) for won in winners.values()) == len(owner) == len(shared), \
        "every key was granted exactly once"
    with KvtierClient(server.socket_path) as client:
        assert client.lookup(shared) == ["arena"] * len(shared)
        got = client_load(client, shared)
    assert got == [pattern(key, owner[key]).tobytes() for key in shared]
    store_of(server).check_integrity()


# ---------------------------------------------------------------------- clients that send garbage

def read_error(sock: socket.socket, *, hangs_up: bool = True) -> Error:
    body = read_frame(sock, 1 << 20)
    assert body is not None
    reply = decode_reply(body)
    assert isinstance(reply, Error)
    if hangs_up:
        assert sock.recv(1) == b"", "the server hung up after the error"
    return reply


def still_serving(server: NodeServer) -> None:
    k = keys(2, "survivor")
    with KvtierClient(server.socket_path) as client:
        if not client.lookup(k):
            client_store(client, k)
        assert client.lookup(k) == ["arena", "arena"]
        assert client_load(client, k) == expected(k)
    store_of(server).check_integrity()


def test_a_malformed_frame_is_answered_with_an_error(server: NodeServer) -> None:
    still_serving(server)
    with raw_connection(server) as sock:
        sock.sendall(struct.pack("<I", 16) + b"\xc1" * 16)  # 0xc1 is never valid msgpack
        error = read_error(sock)
    assert error.code == "protocol" and "malformed request" in error.message
    assert sample(server, "kvtier_protocol_errors_total") == 1
    still_serving(server)


def test_a_reply_sent_as_a_request_is_refused_and_the_connection_stays(
        server: NodeServer) -> None:
    with raw_connection(server) as sock:
        sock.sendall(encode(LookupReply(["arena"])))
        error = read_error(sock, hangs_up=False)
        assert error.code == "bad_request" and "lookup_reply" in error.message
        sock.sendall(encode(Lookup(keys(1))))
        body = read_frame(sock, 1 << 20)
        assert body is not None and decode_reply(body) == LookupReply([], [])
    still_serving(server)


def test_an_oversized_length_prefix_is_refused_unread(make_server: MakeServer) -> None:
    server = make_server(max_message_bytes=4096)
    with raw_connection(server) as sock:
        sock.sendall(struct.pack("<I", 4097))
        error = read_error(sock)
    assert error.code == "protocol"
    assert "4097 bytes exceeds the limit of 4096" in error.message
    still_serving(server)


def test_a_client_disconnecting_mid_frame_is_forgotten(make_server: MakeServer) -> None:
    server = make_server(orphan_grace_s=0.2)
    k = keys(1)
    store = store_of(server)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
    with raw_connection(server) as sock:
        sock.sendall(encode(Lease(list(k))))
        body = read_frame(sock, 1 << 20)
        assert body is not None
        lease = decode_reply(body)
        assert isinstance(lease, LeaseReply) and lease.ready
        assert int(store.arena.leases[lease.slots[0]]) == 1
        sock.sendall(struct.pack("<I", 100) + b"\x81" * 10)  # then hang up, 90 bytes short
    assert wait_until(lambda: not store.leases and sample(server, "kvtier_clients") == 0)
    assert int(store.arena.leases[lease.slots[0]]) == 0
    assert sample(server, "kvtier_protocol_errors_total") == 0
    still_serving(server)


# ---------------------------------------------------------------------- observability

def test_the_metrics_endpoint_counts_hits(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0)
    assert server.metrics_port is not None and server.metrics_port > 0
    k = keys(2)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k)
        assert client_load(client, k) == expected(k)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    assert 'kvtier_hits_total{tier="arena"} 2.0' in text
    assert 'kvtier_chunks{tier="arena"} 2.0' in text
    assert "kvtier_request_seconds_bucket" in text


def test_the_access_log_has_one_json_line_per_named_lookup(tmp_path: Path,
                                                           make_server: MakeServer) -> None:
    log = tmp_path / "logs" / "access.jsonl"
    server = make_server(access_log=str(log))
    k = keys(3)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k[:1])
        assert client.lookup(k, namespace="llama-3-8b/tp0", prompt_tokens=50,
                             chunk_tokens=16) == ["arena"]
        assert client.lookup(k) == ["arena"]  # no namespace: not logged
    lines = log.read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["ns"] == "llama-3-8b/tp0" and entry["op"] == "lookup"
    assert entry["keys"] == [key.hex()[:16] for key in k]
    assert entry["tiers"] == ["arena", None, None]
    assert entry["prompt_tokens"] == 50 and entry["chunk_tokens"] == 16


def test_stats_describe_every_tier(make_server: MakeServer) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    with KvtierClient(server.socket_path) as client:
        client_store(client, keys(3))
        store_of(server).flush()
        stats = client.stats()
    tiers = stats["tiers"]
    assert isinstance(tiers, dict)
    assert tiers["arena"] == {"slots": 4, "free": 1, "ready": 3, "slot_bytes": 8192}
    assert tiers["disk"]["chunks"] == 3 and tiers["disk"]["capacity_bytes"] == 1 << 20
    assert stats["entries"] == 3
