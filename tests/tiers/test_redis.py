"""The redis tier: both conformance suites on a real redis-server, then what only a network
store does: it stops, hangs, comes back empty, and hands back whatever bytes it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from store_helpers import SLOT_BYTES, MakeStore, expected, keys, load, settle, store_chunks

from kvtier import codec
from kvtier.codec import HEADER_SIZE
from kvtier.errors import CorruptChunkError, TierIOError, TierTimeout
from kvtier.services import RedisServer
from kvtier.tiers import TIERS
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_memory import footprint
from kvtier.tiers.shared import SharedTier

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .redis_helpers import FAST, plain, redis_tier
from .shared_conformance import SharedTierConformance

pytestmark = pytest.mark.services


class TestRedisConformance(SharedTierConformance):
    @pytest.fixture(autouse=True)
    def _server(self, redis_server: RedisServer) -> None:
        self.server = redis_server

    def make_tier(self, tmp_path: Path) -> RedisTier:
        return redis_tier(self.server.url)

    def make_peer(self, tier: SharedTier) -> SharedTier:
        assert isinstance(tier, RedisTier)
        return redis_tier(self.server.url, name="peer", key_prefix=tier.options.key_prefix)


def test_registered_as_redis() -> None:
    assert TIERS["redis"] is RedisTier


def test_the_layout_is_what_the_docs_say(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url, key_prefix="app1:")
    key = key_of("layout")
    data = sealed_chunk(key)
    tier.write(key, data)
    tier.put_note("servers/a", b"alive")
    ns, hexkey = NAMESPACE.hex(), key.hex()
    tag = f"{{{ns}:{hexkey[:2]}}}"
    r = plain(redis_server)
    assert sorted(r.keys("*")) == sorted(
        f"app1:{k}".encode() for k in (f"c:{tag}:{hexkey}", f"z:{tag}", f"s:{tag}", "ns",
                                       "n:{app1:n}:servers/a", "nz:{app1:n}"))
    assert r.get(f"app1:c:{tag}:{hexkey}") == bytes(data)
    assert r.hget(f"app1:s:{tag}", hexkey) == str(footprint(len(data))).encode()
    assert r.zscore(f"app1:z:{tag}", hexkey) == pytest.approx(time.time(), abs=5)
    other = redis_tier(redis_server.url, key_prefix="app2:")
    assert list(other.scan()) == [] and other.list_notes("servers/") == []
    tier.close()
    other.close()


def test_a_stopped_server_fails_fast_and_a_restarted_one_serves_again(
        make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    tier = redis_tier(server.url, socket_timeout_s=1.0)
    key = key_of("outage")
    data = sealed_chunk(key)
    tier.write(key, data)
    server.stop()
    for call in (lambda: tier.write(key, data), lambda: read_back(tier, key, len(data)),
                 lambda: list(tier.scan()), lambda: tier.list_notes("journal/")):
        start = time.monotonic()
        with pytest.raises(TierIOError, match="Connection refused") as raised:
            call()
        assert time.monotonic() - start < 1.0, "within the socket timeout"
        assert raised.value.__cause__ is not None  # raised from redis-py's error
    server.start()  # same port, empty: no persistence
    assert read_back(tier, key, len(data)) is None, "the pooled sockets were stale: reconnected"
    tier.write(key, data)
    assert read_back(tier, key, len(data)) == data
    tier.close()


def test_a_hung_server_times_out_and_recovers(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis()
    tier = redis_tier(server.url, socket_timeout_s=0.5)
    key = key_of("hung")
    data = sealed_chunk(key)
    tier.write(key, data)
    server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(TierTimeout):
            read_back(tier, key, len(data))
        assert 0.4 < time.monotonic() - start < 1.4, "one socket timeout, no retry"
    finally:
        server.resume()
    assert read_back(tier, key, len(data)) == data
    tier.close()


def test_a_corrupted_value_is_returned_and_fails_verification(redis_server: RedisServer
                                                              ) -> None:
    tier = redis_tier(redis_server.url)
    key = key_of("corrupted")
    data = sealed_chunk(key)
    tier.write(key, data)
    name = tier.layout.chunk(NAMESPACE.hex(), key.hex())
    r = plain(redis_server)
    flipped = bytearray(data)
    flipped[codec.HEADER_SIZE + 50] ^= 0xFF
    for garbage in (b"\x5a" * len(data),                      # overwritten whole
                    bytes(flipped),                            # one payload byte flipped
                    bytes(data[: codec.HEADER_SIZE + 100])):  # truncated
        r.set(name, garbage)
        dst = page_buffer(len(data))
        n = tier.read_into(key, dst, namespace=NAMESPACE)
        assert n == len(garbage) and dst[:n] == garbage
        with pytest.raises(CorruptChunkError):
            codec.verify(dst[:n], key, NAMESPACE)
    r.set(name, b"x" * (len(data) + 1))
    with pytest.raises(CorruptChunkError, match="more than"):
        tier.read_into(key, page_buffer(len(data)), namespace=NAMESPACE)
    tier.close()


def test_reconcile_drops_what_redis_lost_and_keeps_the_rest(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url)
    keys = [key_of(f"reconcile {i}") for i in range(1200)]  # more than one batch
    for key in keys:
        tier.write(key, sealed_chunk(key, 100))
    tier.put_note("journal/1", b"a")
    tier.put_note("journal/2", b"b")
    r = plain(redis_server)
    lost = keys[::3]
    r.delete(*[tier.layout.chunk(NAMESPACE.hex(), k.hex()) for k in lost],
             tier.layout.note("journal/1"))
    assert len(list(tier.scan())) == len(keys), "the index still names them"
    assert read_back(tier, lost[0], 2 * codec.PAGE) is None, "a miss, not an error"
    assert tier.clean_stale_temps(3600) == len(lost) + 1
    assert {c.key for c in tier.scan()} == set(keys) - set(lost)
    assert tier.list_notes("journal/") == ["journal/2"]
    assert tier.reconcile() == 0
    for key in keys:
        tier.delete(key, namespace=NAMESPACE)
    assert tier.namespaces() == [] and tier.reconcile() == 0
    assert not r.exists("kvtier:ns"), "an empty namespace is forgotten"
    tier.close()


def test_chunk_ttl_expires_chunks_but_never_the_index(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url, chunk_ttl_s=3600)
    key = key_of("ttl")
    tier.write(key, sealed_chunk(key))
    r = plain(redis_server)
    ns = NAMESPACE.hex()
    chunk = tier.layout.chunk(ns, key.hex())
    assert 3590_000 < r.pttl(chunk) <= 3600_000
    bucket = key.hex()[:2]
    assert r.pttl(tier.layout.index(ns, bucket)) == -1
    assert r.pttl(tier.layout.sizes(ns, bucket)) == -1
    r.pexpire(chunk, 10_000)
    tier.touch(key, namespace=NAMESPACE)
    assert r.pttl(chunk) > 3590_000, "a touch renews the TTL"
    tier.close()


def test_bench_runs_with_tiny_sizes(redis_server: RedisServer) -> None:
    from kvtier.bench.shared_redis import bench_redis

    figures = bench_redis(redis_server.url, sizes=(64 << 10, 128 << 10), count=4, repeats=2)
    for name in ("redis_read_ratio", "redis_write_ratio", "redis_read_ratio_64KiB",
                 "redis_plain_set_MBps_128KiB", "redis_tier_read_MBps_128KiB"):
        assert figures[name] > 0, name
    assert plain(redis_server).dbsize() == 0, "the bench removes what it wrote"


def test_a_refused_transaction_puts_the_key_back_and_leaves_the_pool_usable(
        redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url, max_connections=1)  # one socket: any leftover shows
    key, other = key_of("in the way"), key_of("after")
    r = plain(redis_server)
    index = tier.layout.index(NAMESPACE.hex(), key.hex()[:2])
    r.set(index, b"not a sorted set")  # another program's key
    tier.write(key, sealed_chunk(key))  # refused (WRONGTYPE), the index made again, written
    assert r.type(index) == b"zset"
    assert tier.skips.counts["index keys of another type, replaced"] == 1
    data = sealed_chunk(other, seed=3)
    tier.write(other, data)
    assert read_back(tier, other, len(data)) == data
    assert {c.key for c in tier.scan()} == {key, other}
    tier.close()


@pytest.mark.parametrize("stored", [15 * codec.PAGE, 16 * codec.PAGE, 17 * codec.PAGE])
def test_footprints_match_what_redis_uses(redis_server: RedisServer, stored: int) -> None:
    """60 KiB fits its class, 64 KiB tips over into 80 KiB: the estimate follows INFO."""
    tier = redis_tier(redis_server.url)
    r = plain(redis_server)
    warm = key_of("warm")
    tier.write(warm, sealed_chunk(warm, stored - codec.HEADER_SIZE))
    before = int(r.info("memory")["used_memory"])
    counted = 0
    for i in range(200):
        key = key_of(f"footprint {i}")
        counted += tier.write(key, sealed_chunk(key, stored - codec.HEADER_SIZE))
    used = int(r.info("memory")["used_memory"]) - before
    assert abs(counted - used) < 0.02 * used, (counted, used)
    tier.close()


def test_the_packed_transaction_is_what_redis_py_would_send() -> None:
    import redis

    from kvtier.tiers.redis_wire import BIG, pack_transaction

    big = memoryview(bytearray(range(256)) * (BIG // 256 + 3))
    commands = [(b"SET", "k:é", big, b"PX", 5000), (b"ZADD", "z", 1796114413.6386638, "m"),
                (b"HSET", "h", "m", 12), (b"SET", "small", memoryview(b"tiny"))]
    parts = pack_transaction(commands)
    assert any(p is not big and isinstance(p, memoryview) and p.obj is big.obj for p in parts), \
        "the big value is sent as it is, not copied into the packet"
    reference = redis.Connection().pack_commands([("MULTI",), *commands, ("EXEC",)])
    assert b"".join(map(bytes, parts)) == b"".join(map(bytes, reference))


def test_a_chunk_another_server_wrote_is_offered_here(redis_server: RedisServer,
                                                      make_store: MakeStore,
                                                      tmp_path: Path) -> None:
    """Redis books a chunk at its memory footprint, more than the chunk: a full-size chunk
    must still count as fitting this server's slots (the cross-node e2e case)."""
    tier = {"type": "redis", "name": "shared", "capacity_bytes": 1 << 26, "io_threads": 2,
            "options": {"url": redis_server.url, **FAST}}
    writer = make_store(tmp_path / "a", tiers=[tier])
    writer.rebuild()
    k = keys(3, "peer")
    store_chunks(writer, k, n=SLOT_BYTES - HEADER_SIZE)  # as big as a slot takes
    settle(writer)
    reader = make_store(tmp_path / "b", tiers=[tier])
    reader.rebuild()
    assert reader.tiers[0].sizes[k[0]] > SLOT_BYTES, "booked at its footprint"
    assert reader.lookup(k) == ["shared"] * 3
    assert load(reader, k, n=SLOT_BYTES - HEADER_SIZE).payloads == expected(
        k, n=SLOT_BYTES - HEADER_SIZE)
    reader.check_integrity()


OLD_LAYOUT_PATTERNS = ("kvtier:c:[0-9a-f]*", "kvtier:z:[0-9a-f]*", "kvtier:s:[0-9a-f]*",
                       "kvtier:n:[a-z]*", "kvtier:nz")
"""docs/shared-redis.md's redis-cli patterns for the keys of the layout without hash tags."""


def test_keys_of_the_old_layout_are_misses_and_the_docs_patterns_match_only_them(
        redis_server: RedisServer) -> None:
    r = plain(redis_server)
    key = key_of("old layout")
    data = sealed_chunk(key)
    ns, hexkey = NAMESPACE.hex(), key.hex()
    old = {f"kvtier:c:{ns}:{hexkey}", f"kvtier:z:{ns}", f"kvtier:s:{ns}",
           "kvtier:n:journal/1-a-1", "kvtier:nz"}
    r.set(f"kvtier:c:{ns}:{hexkey}", bytes(data))
    r.zadd(f"kvtier:z:{ns}", {hexkey: time.time()})
    r.hset(f"kvtier:s:{ns}", hexkey, len(data))
    r.sadd("kvtier:ns", ns)
    r.set("kvtier:n:journal/1-a-1", b"old note")
    r.zadd("kvtier:nz", {"journal/1-a-1": 0})
    tier = redis_tier(redis_server.url)
    assert read_back(tier, key, len(data)) is None, "an old chunk is a miss"
    assert list(tier.scan()) == [] and tier.namespaces() == []
    assert tier.list_notes("journal/") == []
    assert tier.reconcile() == 0 and not r.sismember("kvtier:ns", ns), "forgotten"
    tier.write(key, data)
    tier.put_note("journal/2-b-1", b"new note")
    assert read_back(tier, key, len(data)) == data
    matched = {k.decode() for p in OLD_LAYOUT_PATTERNS for k in r.scan_iter(match=p)}
    assert matched == old, "the cleanup removes the old keys, never a new one"
    tier.close()
