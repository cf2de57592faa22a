"""The redis tier on a Redis Cluster of its own (3 primaries, 3 replicas on loopback): both
conformance suites, keys spread over every primary, the wrong mode named, and a primary killed
under load: misses or the promoted replica's bytes, never a wrong block, nothing stuck."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from store_helpers import MakeStore, expected, keys, load, settle, store_chunks

from kvtier import codec
from kvtier.errors import CorruptChunkError, TierIOError
from kvtier.services import RedisCluster, RedisServer
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_layout import BUCKETS
from kvtier.tiers.shared import SharedTier

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .redis_helpers import redis_tier
from .shared_conformance import SharedTierConformance

pytestmark = pytest.mark.services
MakeCluster = Callable[..., RedisCluster]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster() as started:
        yield started


def cluster_tier(url: str, name: str = "shared", **options: object) -> RedisTier:
    return redis_tier(url, name, cluster=True, **options)


class TestRedisClusterConformance(SharedTierConformance):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster: RedisCluster) -> None:
        self.cluster = cluster

    def make_tier(self, tmp_path: Path) -> RedisTier:
        # a prefix of its own: an empty tier on the shared cluster
        return cluster_tier(self.cluster.url, key_prefix=f"t{uuid.uuid4().hex[:12]}:")

    def make_peer(self, tier: SharedTier) -> SharedTier:
        assert isinstance(tier, RedisTier)
        return cluster_tier(self.cluster.nodes[1].url, name="peer",
                            key_prefix=tier.options.key_prefix)


def test_keys_and_index_buckets_spread_over_every_primary(cluster: RedisCluster) -> None:
    tier = cluster_tier(cluster.url, key_prefix="spread:")
    keys = [key_of(f"spread {i}") for i in range(200)]
    for key in keys:
        tier.write(key, sealed_chunk(key, 100))
    ns = NAMESPACE.hex()
    for node in cluster.primary_nodes():
        r = redis.Redis(host=node.host, port=node.port)
        held = set(r.scan_iter(match="spread:z:*", count=1000))
        assert 40 < len(held) < 120, f"{node}: {len(held)} of the index buckets"
        assert any(k.startswith(b"spread:c:") for k in r.scan_iter(match="spread:c:*"))
        r.close()
    assert {c.key for c in tier.scan()} == set(keys)
    assert tier.namespaces() == [NAMESPACE]
    assert len({tier.layout.index(ns, b) for b in BUCKETS}) == 256
    assert tier.describe()["cluster"] is True
    for key in keys:
        tier.delete(key, namespace=NAMESPACE)
    assert tier.reconcile() == 0 and tier.namespaces() == []
    tier.close()


def test_values_of_another_type_under_index_keys_are_replaced_on_their_nodes(
        cluster: RedisCluster) -> None:
    """A peer's strings where the namespace set, the note names and index and size buckets
    belong (spread over the primaries) are replaced by the writes, deletes and notes that
    meet them, each on the node of its slot: nothing lost to the tier but what they held."""
    tier = cluster_tier(cluster.url, key_prefix="typed:")
    ns, layout = NAMESPACE.hex(), tier.layout
    keys = [key_of(f"typed {i}") for i in range(12)]
    buckets = sorted({k.hex()[:2] for k in keys})
    squatted = [layout.namespaces, layout.notes, *(layout.index(ns, b) for b in buckets),
                *(layout.sizes(ns, b) for b in buckets)]
    owners = {name: cluster.owner_of(name) for name in squatted}
    assert len({node.port for node in owners.values()}) >= 2, "the keys are on several nodes"
    for name, node in owners.items():
        with redis.Redis(host=node.host, port=node.port) as r:
            r.set(name, b"not an index")
    for key in keys:
        tier.write(key, sealed_chunk(key))
    tier.put_note("journal/a", b"a note")
    for name, node in owners.items():
        with redis.Redis(host=node.host, port=node.port) as r:
            assert r.type(name) in {b"set", b"zset", b"hash"}, name
    assert tier.skips.counts["index keys of another type, replaced"] == len(squatted)
    assert {c.key for c in tier.scan()} == set(keys)
    assert tier.namespaces() == [NAMESPACE]
    assert tier.list_notes("journal") == ["journal/a"]
    victim = layout.index(ns, keys[0].hex()[:2])
    with redis.Redis(host=owners[victim].host, port=owners[victim].port) as r:
        r.set(victim, b"again")
        tier.delete(keys[0], namespace=NAMESPACE)  # refused, the string dropped, deleted
        assert r.type(victim) == b"none"
    lost = {k for k in keys if k.hex()[:2] == keys[0].hex()[:2]}  # what the bucket held
    assert {c.key for c in tier.scan()} == set(keys) - lost
    assert tier.skips.counts["index keys of another type, replaced"] == len(squatted) + 1
    assert read_back(tier, keys[0], len(sealed_chunk(keys[0]))) is None
    tier.close()


def test_every_node_of_the_cluster_names_the_tier_alike(cluster: RedisCluster) -> None:
    """The scope in a note's MAC names no address: servers that reach the cluster through
    different nodes sign and accept each other's notes; a single server is told apart."""
    tiers = [cluster_tier(node.url, key_prefix="scope:") for node in cluster.nodes[:3]]
    assert {t.backend_scope() for t in tiers} == {"redis-cluster:scope:"}
    assert {t.note_scope for t in tiers} == {"redis-cluster:scope:"}
    single = redis_tier(cluster.nodes[0].url, key_prefix="scope:")
    assert single.backend_scope() == "redis:0/scope:"
    for tier in [*tiers, single]:
        tier.close()


def test_the_wrong_mode_is_named(cluster: RedisCluster, redis_server: RedisServer) -> None:
    single = redis_tier(cluster.url, key_prefix="mode:")
    with pytest.raises(TierIOError, match="cluster: true"):
        for i in range(20):  # some keys are on the node asked: the first MOVED says it
            key = key_of(f"mode {i}")
            single.write(key, sealed_chunk(key))
    single.close()
    clustered = cluster_tier(redis_server.url)
    with pytest.raises(TierIOError, match="cluster: false"):
        clustered.write(key_of("x"), sealed_chunk(key_of("x")))
    clustered.close()


def test_a_primary_killed_under_load_costs_misses_never_a_wrong_block(
        make_redis_cluster: MakeCluster) -> None:
    cluster = make_redis_cluster(node_timeout_ms=1000)
    timeout_s = 1.0
    tier = cluster_tier(cluster.url, socket_timeout_s=timeout_s, connect_timeout_s=0.5,
                        retries=1)
    keys = [key_of(f"failover {i}") for i in range(120)]
    chunks = {key: sealed_chunk(key, 2 * codec.PAGE, seed=i) for i, key in enumerate(keys)}
    for key, data in chunks.items():
        tier.write(key, data)
    victim = cluster.owner_of(tier.layout.chunk(NAMESPACE.hex(), keys[0].hex()))
    outcomes = {"hit": 0, "miss": 0, "error": 0}
    slowest = 0.0
    stop = threading.Event()
    wrong: list[str] = []

    def load() -> None:
        nonlocal slowest
        deadline = time.monotonic() + 25
        i = 0
        while not stop.is_set() and time.monotonic() < deadline:
            key = keys[i % len(keys)]
            i += 1
            start = time.monotonic()
            try:
                got = read_back(tier, key, len(chunks[key]))
                if got is None:
                    outcomes["miss"] += 1
                else:
                    try:
                        codec.verify(got, key, NAMESPACE)
                    except CorruptChunkError as exc:
                        wrong.append(str(exc))
                    if got != chunks[key]:
                        wrong.append(key.hex())
                    outcomes["hit"] += 1
                if i % 4 == 0:
                    tier.write(key, chunks[key])
            except TierIOError:
                outcomes["error"] += 1  # the store counts these as misses, breaker decides
            slowest = max(slowest, time.monotonic() - start)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    time.sleep(0.5)
    victim.kill()  # SIGKILL: no goodbye to the cluster or the clients
    cluster.wait_promoted(victim, timeout_s=20)
    time.sleep(1.0)
    stop.set()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a call hung"
    assert not wrong, f"wrong blocks served: {wrong[:3]}"
    assert outcomes["error"] > 0 and outcomes["hit"] > 0, outcomes
    # each call: (1 + retries) tries of connect / socket timeouts, a map reload in between
    assert slowest < 2 * (timeout_s + 0.5) + 1.0, f"a call took {slowest:.1f} s"
    for key, data in chunks.items():  # after failover: every slot is served again
        got = read_back(tier, key, len(data))
        assert got is None or got == data
        tier.write(key, data)
        assert read_back(tier, key, len(data)) == data
    assert {c.key for c in tier.scan()} == set(keys)
    tier.close()


def test_a_read_never_exceeds_the_buffer_on_any_node(cluster: RedisCluster) -> None:
    tier = cluster_tier(cluster.url, key_prefix="bounded:")
    keys = [key_of(f"bounded {i}") for i in range(12)]
    for key in keys:
        data = sealed_chunk(key)
        tier.write(key, data)
        dst = page_buffer(len(data))
        assert tier.read_into(key, dst, namespace=NAMESPACE) == len(data)
        assert read_back(tier, key, len(data)) == data
    tier.close()


def test_bench_runs_on_the_cluster_with_tiny_sizes(cluster: RedisCluster) -> None:
    from kvtier.bench.shared_redis import bench_redis

    figures = bench_redis(cluster.url, sizes=(64 << 10,), count=4, repeats=2, cluster=True)
    for name in ("redis_cluster_read_ratio", "redis_cluster_write_ratio",
                 "redis_cluster_plain_get_MBps_64KiB", "redis_cluster_tier_write_MBps_64KiB"):
        assert figures[name] > 0, name
    for node in cluster.primary_nodes():
        r = redis.Redis(host=node.host, port=node.port)
        assert not list(r.scan_iter(match="kvtier-bench-*")), "the bench removes what it wrote"
        r.close()


def test_two_servers_share_chunks_through_the_cluster_and_outlive_a_primary(
        make_redis_cluster: MakeCluster, make_store: MakeStore, tmp_path: Path) -> None:
    cluster = make_redis_cluster(node_timeout_ms=1000)
    tier = {"type": "redis", "name": "shared", "capacity_bytes": 1 << 28, "io_threads": 2,
            "options": {"url": cluster.url, "cluster": True, "socket_timeout_s": 1.0,
                        "connect_timeout_s": 0.5,
                        "nodes": [f"{n.host}:{n.port}" for n in cluster.nodes[1:]]}}
    writer = make_store(tmp_path / "a", tiers=[tier], slots=32)
    writer.rebuild()
    k = keys(24, "through the cluster")
    store_chunks(writer, k)
    settle(writer)
    reader = make_store(tmp_path / "b", tiers=[tier], slots=32)
    reader.rebuild()  # from the listing of every primary's buckets
    assert reader.lookup(k) == ["shared"] * len(k)
    assert load(reader, k).payloads == expected(k)
    reader.check_integrity()

    victim = cluster.nodes[0]  # the url's node: a server started later asks the others
    assert cluster.role(victim) == "master"
    victim.kill()
    start = time.monotonic()
    got = load(reader, k).payloads  # the lease holds what the arena already has
    assert time.monotonic() - start < 12
    assert all(p is None or p == e for p, e in zip(got, expected(k), strict=True))
    cluster.wait_promoted(victim, timeout_s=20)
    later = keys(8, "after failover")
    deadline = time.monotonic() + 30  # the breaker's probe lets the tier back in
    while time.monotonic() < deadline:
        store_chunks(writer, later)
        settle(writer)
        fresh = make_store(tmp_path / f"c{int(time.monotonic() * 1000)}", tiers=[tier],
                           slots=32)
        fresh.rebuild()
        if fresh.lookup(later) == ["shared"] * len(later):
            break
        time.sleep(1.0)
    assert fresh.lookup(later) == ["shared"] * len(later), "the tier works after failover"
    loaded = load(fresh, later).payloads
    assert all(p is None or p == e for p, e in zip(loaded, expected(later), strict=True))
    fresh.check_integrity()
    writer.check_integrity()


def test_writes_go_on_while_the_namespace_sets_primary_is_down(
        make_redis_cluster: MakeCluster, caplog: pytest.LogCaptureFixture) -> None:
    cluster = make_redis_cluster(node_timeout_ms=4000)  # the others serve meanwhile
    tier = cluster_tier(cluster.url, key_prefix="ns-down:",
                        nodes=[f"{n.host}:{n.port}" for n in cluster.nodes[1:]])
    victim = cluster.owner_of(tier.layout.namespaces)
    ns = NAMESPACE.hex()
    elsewhere = [k for k in (key_of(f"elsewhere {i}") for i in range(12))
                 if cluster.owner_of(tier.layout.chunk(ns, k.hex())) is not victim][:4]
    assert elsewhere
    victim.kill()
    for key in elsewhere:
        tier.write(key, sealed_chunk(key))  # the namespace set is down, the chunks are not
        assert read_back(tier, key, len(sealed_chunk(key))) == sealed_chunk(key)
    assert sum("the namespace is listed once it is added" in r.getMessage()
               for r in caplog.records) == 1, "one line, not one per write"
    cluster.wait_promoted(victim, timeout_s=30)
    deadline = time.monotonic() + 10
    while tier.namespaces() != [NAMESPACE] and time.monotonic() < deadline:
        time.sleep(0.5)
        tier.write(elsewhere[0], sealed_chunk(elsewhere[0]))  # adds it again, a second later
    assert tier.namespaces() == [NAMESPACE]
    assert set(elsewhere) <= {c.key for c in tier.scan()}
    tier.close()
