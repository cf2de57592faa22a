"""Redis evicting on its own (maxmemory): the tier keeps working, reads return the bytes
written or nothing, and reconcile brings the index back in line with what Redis kept."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest

from kvtier import codec
from kvtier.errors import TierFull
from kvtier.keys import ChunkKey
from kvtier.services import RedisServer
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis_layout import BUCKETS

from .conformance import NAMESPACE, key_of, read_back, sealed_chunk
from .redis_helpers import plain, redis_tier

pytestmark = pytest.mark.services
MakeRedis = Callable[..., RedisServer]
MAXMEMORY = 4 << 20
PAYLOAD = 15 * codec.PAGE  # 64 KiB stored


def fill(tier: RedisTier, count: int, stop: Callable[[], bool] = lambda: False
         ) -> dict[ChunkKey, memoryview]:
    """Write ``count`` chunks (far more than fit), reading earlier ones back as it goes."""
    written: dict[ChunkKey, memoryview] = {}
    rng = random.Random(1)
    for i in range(count):
        key = key_of(f"evicted {i}")
        written[key] = sealed_chunk(key, PAYLOAD, seed=i)
        tier.write(key, written[key])
        tier.touch(rng.choice(list(written)), namespace=NAMESPACE)
        tier.put_note(f"journal/{i:06d}", b"x" * 100)
        probe = rng.choice(list(written))
        assert read_back(tier, probe, len(written[probe])) in (None, written[probe])
        if stop():
            break
    return written


def check_everything_answers(tier: RedisTier, server: RedisServer,
                             written: dict[ChunkKey, memoryview]) -> None:
    kept = [k for k, data in written.items() if read_back(tier, k, len(data)) == data]
    missed = [k for k, data in written.items() if read_back(tier, k, len(data)) is None]
    assert len(kept) + len(missed) == len(written), "bytes written or a miss, nothing else"
    assert kept and missed, "Redis kept some and evicted others"
    r = plain(server)
    ns = NAMESPACE.hex()

    def stale() -> list[ChunkKey]:
        return [c.key for c in tier.scan() if not r.exists(tier.layout.chunk(ns, c.key.hex()))]

    # a batch whose check conflicts (WATCH) is kept for the next pass, by design, and under
    # allkeys-lru Redis may evict index entries' keys itself meanwhile: a few passes leave no
    # entry naming a chunk that is gone
    dropped = [tier.reconcile()]
    while stale() and len(dropped) < 5:
        dropped.append(tier.reconcile())
    assert not stale(), dropped
    listed = {c.key for c in tier.scan()}
    assert listed <= set(kept), "after reconcile the index names only chunks that are there"
    # docs/shared.md: under allkeys-* an evicted note reads None while list_notes may still
    # name it (until the next reconcile); never other bytes.
    for name in tier.list_notes("journal/"):
        assert tier.get_note(name) in (b"x" * 100, None)


def test_allkeys_lru_evicts_chunks_and_the_tier_keeps_working(make_redis: MakeRedis,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    caplog.set_level(logging.WARNING, "kvtier.tiers.redis")
    server = make_redis(maxmemory=MAXMEMORY, maxmemory_policy="allkeys-lru")
    tier = redis_tier(server.url, capacity_bytes=1 << 30)
    assert tier.describe()["maxmemory_policy"] == "allkeys-lru"
    assert caplog.records == [], "maxmemory with allkeys-lru: nothing to warn about"
    written = fill(tier, 150)
    assert int(plain(server).info("stats")["evicted_keys"]) > 50
    check_everything_answers(tier, server, written)
    tier.close()


def test_evicted_index_structures_break_nothing(make_redis: MakeRedis) -> None:
    """allkeys-random evicts any key: index buckets, size buckets and the note index go
    too, at random, while the tier is used (a write re-creates them with its own entry)."""
    server = make_redis(maxmemory=MAXMEMORY, maxmemory_policy="allkeys-random")
    tier = redis_tier(server.url)
    r = plain(server)
    ns = NAMESPACE.hex()

    def total(command: str, names: list[str]) -> Callable[[], int]:
        def count() -> int:
            with r.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.execute_command(command, name)
                return sum(pipe.execute())
        return count

    count = {"index buckets": total("ZCARD", [tier.layout.index(ns, b) for b in BUCKETS]),
             "size buckets": total("HLEN", [tier.layout.sizes(ns, b) for b in BUCKETS]),
             "note index": total("ZCARD", [tier.layout.notes])}
    last = dict.fromkeys(count, 0)
    lost: set[str] = set()

    def an_index_was_evicted() -> bool:  # nothing is deleted: only eviction shrinks them
        for name, size_of in count.items():
            now = size_of()
            if now < last[name]:
                lost.add(name)
            last[name] = now
        return len(lost) == len(count)

    written = fill(tier, 3000, stop=an_index_was_evicted)
    assert lost == set(count), "Redis evicted every index structure at least once"
    fill(tier, 40)  # and the tier goes on writing, touching, listing afterwards
    for _ in range(3):
        assert tier.namespaces() in ([], [NAMESPACE])
        list(tier.scan())
        tier.reconcile()
    answers = [read_back(tier, k, len(d)) for k, d in written.items()]
    assert all(a is None or a == d for a, d in zip(answers, written.values(), strict=True))
    tier.close()


def test_noeviction_at_maxmemory_is_a_full_tier(make_redis: MakeRedis,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "kvtier.tiers.redis")
    server = make_redis(maxmemory=MAXMEMORY, maxmemory_policy="noeviction")
    tier = redis_tier(server.url, capacity_bytes=1 << 30)
    assert [r.getMessage() for r in caplog.records if "refuses writes" in r.getMessage()], \
        "one warning: Redis will refuse writes below capacity_bytes"
    assert len(caplog.records) == 1
    with pytest.raises(TierFull, match="maxmemory"):
        fill(tier, 150)
    key = key_of("evicted 0")
    assert read_back(tier, key, codec.stored_size(PAYLOAD)) == sealed_chunk(key, PAYLOAD, seed=0)
    tier.delete(key, namespace=NAMESPACE)  # deletes still work at maxmemory
    tier.close()
