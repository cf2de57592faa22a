"""What only a cluster can hand the redis tier: a slot map, redirects, and index buckets on
many nodes. A bad map is refused, redirects are bounded and never lead off the map, and garbage
in any node's buckets costs a listing that entry, never the listing."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import AskError

from kvtier.errors import TierIOError
from kvtier.services import RedisCluster
from kvtier.tiers.redis_nodes import SLOTS, BadSlotMap, ClusterNodes, parse_slots

from .conformance import NAMESPACE, key_of, read_back, sealed_chunk
from .redis_helpers import redis_tier

pytestmark = pytest.mark.services
HERE = ("127.0.0.1", 7000)


@pytest.mark.parametrize(("reply", "wrong"), [
    (b"a string", "not a list"),
    ([[0, 16384, [b"127.0.0.1", 7000]]], "not within"),
    ([[5, 1, [b"127.0.0.1", 7000]]], "not within"),
    ([[0, 10, [b"127.0.0.1", 0]]], "host or port"),
    ([[0, 10, [b"127.0.0.1", b"7000"]]], "host or port"),
    ([[0, 10, [b"evil host\r\n", 7000]]], "not a host name"),
    ([[0, 10]], "not \\[start, end, primary"),
    ([[i, i, [b"10.0.0.1", 1 + i]] for i in range(1001)], "more than 1000 primaries"),
    ([[0, 0, [b"h", 1]]] * (SLOTS + 1), "not a list of at most"),
])
def test_a_bad_slot_map_is_refused_naming_what_is_wrong(reply: Any, wrong: str) -> None:
    with pytest.raises(BadSlotMap, match=wrong):
        parse_slots(reply, HERE)


def test_an_unnamed_host_is_the_node_asked() -> None:
    found = parse_slots([[0, 16383, [b"", 7001, b"id"]]], HERE)
    assert found.primaries == [("127.0.0.1", 7001)]
    partial = parse_slots([[0, 99, [b"?", 7002]]], HERE)
    assert partial.owners[100] is None and partial.owners[99] == ("127.0.0.1", 7002)


HELLO = b"%1\r\n$5\r\nproto\r\n:3\r\n"
"""redis-py 8 opens each connection with HELLO 3 (RESP3)."""


def split_commands(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The names of the whole RESP commands at the start of ``buffer``, and the rest."""
    names = []
    while True:
        at, parts = 0, []
        header = buffer.find(b"\r\n")
        if not buffer.startswith(b"*") or header < 0:
            return names, buffer
        at = header + 2
        for _ in range(int(buffer[1:header])):
            end = buffer.find(b"\r\n", at)
            if end < 0:
                return names, buffer
            size = int(buffer[at + 1:end])
            if len(buffer) < end + 2 + size + 2:
                return names, buffer
            parts.append(buffer[end + 2:end + 2 + size])
            at = end + 2 + size + 2
        names.append(parts[0].upper() if parts else b"")
        buffer = buffer[at:]


class FakeNode:
    """A socket that answers like a cluster node of a hostile kind: ``slots`` to CLUSTER
    SLOTS, ``other`` to anything else (one reply per command)."""

    def __init__(self, slots: bytes, other: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.slots, self.other = slots, other
        self.requests = 0
        self.seen: Counter[bytes] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        buffer = b""
        with conn:
            while not self._stop.is_set():
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                buffer += data
                commands, buffer = split_commands(buffer)
                for name in commands:
                    self.requests += 1
                    self.seen[name] += 1
                    try:
                        conn.sendall(self.reply(name))
                    except OSError:  # the client gave up on this connection
                        return

    def reply(self, name: bytes) -> bytes:
        if name == b"HELLO":
            return HELLO
        if name == b"CLUSTER":
            return self.slots
        if name == b"CLIENT":  # redis-py's CLIENT SETINFO after connecting
            return b"+OK\r\n"
        return self.other.replace(b"PORT", str(self.port).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def fake() -> Iterator[list[FakeNode]]:
    made: list[FakeNode] = []
    yield made
    for node in made:
        node.close()


def test_a_node_with_a_garbage_map_fails_calls_fast_and_clearly(fake: list[FakeNode]) -> None:
    node = FakeNode(b"*1\r\n*3\r\n:0\r\n:99999\r\n*2\r\n$9\r\n127.0.0.1\r\n:1\r\n", b"+OK\r\n")
    fake.append(node)
    tier = redis_tier(f"redis://127.0.0.1:{node.port}/0", cluster=True)
    key = key_of("garbage map")
    start = time.monotonic()
    with pytest.raises(TierIOError, match="CLUSTER SLOTS: range 0-99999"):
        tier.write(key, sealed_chunk(key))
    with pytest.raises(TierIOError, match="CLUSTER SLOTS"):
        read_back(tier, key, 4096)
    assert time.monotonic() - start < 2.0
    tier.close()


def test_redirects_in_a_loop_are_bounded(fake: list[FakeNode]) -> None:
    slots = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:PORT\r\n"
    node = FakeNode(b"", b"-MOVED 42 127.0.0.1:PORT\r\n")
    node.slots = slots.replace(b"PORT", str(node.port).encode())
    fake.append(node)
    tier = redis_tier(f"redis://127.0.0.1:{node.port}/0", cluster=True, retries=1)
    key = key_of("moved forever")
    start = time.monotonic()
    with pytest.raises(TierIOError, match="still redirected"):
        tier.write(key, sealed_chunk(key))
    assert time.monotonic() - start < 3.0, "no endless chase"
    # the namespace's SADD and the chunk's writes, each in a MULTI of its own:
    # (1 + retries) x (1 + 3 redirects) each
    assert node.seen[b"SADD"] <= 8 and node.seen[b"SET"] <= 8, node.seen
    assert node.seen[b"MULTI"] <= 16, node.seen
    tier.close()


def test_an_ask_to_a_node_off_the_map_is_not_followed(fake: list[FakeNode]) -> None:
    slots = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:PORT\r\n"
    node = FakeNode(b"", b"+OK\r\n")
    node.slots = slots.replace(b"PORT", str(node.port).encode())
    fake.append(node)
    made: list[tuple[str, int]] = []

    def make(host: str, port: int) -> redis.Redis:
        made.append((host, port))
        return redis.Redis(host=host, port=port, socket_timeout=1)

    nodes = ClusterNodes([("127.0.0.1", node.port)], make)
    assert nodes.client_for("k").connection_pool.connection_kwargs["port"] == node.port
    with pytest.raises(redis.ConnectionError, match="not followed"):
        nodes.asking(AskError("1 10.9.9.9:6379"))
    assert ("10.9.9.9", 6379) not in made
    nodes.close()


def test_garbage_in_buckets_on_every_node_costs_only_those_entries(tmp_path: Any) -> None:
    with RedisCluster() as cluster:
        tier = redis_tier(cluster.url, cluster=True, key_prefix="g:")
        good = [key_of(f"good {i}") for i in range(40)]
        for key in good:
            tier.write(key, sealed_chunk(key))
        ns = NAMESPACE.hex()
        plain = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        buckets = sorted({k.hex()[:2] for k in good})
        for b in buckets:  # on whichever primary serves each bucket's slot
            index = tier.layout.index(ns, b)
            stray = ("e" if b[0] != "e" else "d") * 64
            plain.zadd(index, {stray: 1.0, b"not a key": 2.0})
        empty = next(b for b in ("00", "01", "02", "03") if b not in buckets)
        plain.set(tier.layout.index(ns, empty), b"a string where a bucket belongs")
        plain.sadd(tier.layout.namespaces, b"\x00garbage")
        assert {c.key for c in tier.scan()} == set(good)
        assert tier.skips.counts["index members in another key's bucket"] == len(buckets)
        assert tier.skips.counts["index members that are not 64-hex keys"] == len(buckets)
        assert tier.skips.counts["index keys of another type"] >= 1
        assert tier.reconcile() == 0, "entries of other buckets are neither read nor dropped"
        for key in good:
            assert read_back(tier, key, len(sealed_chunk(key))) == sealed_chunk(key)
        plain.close()
        tier.close()
