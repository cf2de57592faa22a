"""The redis tier against another program writing under its prefix (issue 15, item 4):
garbage in the index present when servers start, values of the wrong type under the tier's
keys, and values far larger than any chunk or note. Every story ends with every good chunk
listed and served, and nothing large ever held in the client's memory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from store_helpers import (
    NS,
    SLOT_BYTES,
    MakeServer,
    MakeStore,
    expected,
    keys,
    load,
    peak_bytes,
    settle,
    store_chunks,
    store_of,
    wait_until,
)

from kvtier import codec
from kvtier.errors import ChunkTooLarge, NoteTooLarge
from kvtier.services import RedisServer
from kvtier.tiers.redis_layout import Layout
from kvtier.tiers.redis_memory import footprint

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .redis_helpers import FAST, plain, redis_tier

pytestmark = pytest.mark.services

MiB = 1 << 20
BIG = 64 * MiB
"""A value no chunk or note is: created on the server with SETRANGE, never sent by us."""


def redis_tier_dict(url: str) -> dict[str, Any]:
    return {"type": "redis", "name": "shared", "capacity_bytes": 1 << 26, "io_threads": 2,
            "options": {"url": url, **FAST}}


def plant_garbage(r: Any, layout: Layout, ns: str, good: list[str]) -> None:
    """What another program could leave under the tier's prefix."""
    other = "ab" * 32  # a namespace whose index is a string, not a sorted set
    bucket = good[0][:2]
    stray = next(b * 32 for b in ("ee", "dd") if b != bucket)  # a key of another bucket
    r.sadd(layout.namespaces, b"\xff", b"not hex", "AB" * 32, "0" * 63, other)
    r.set(layout.index(other, "00"), b"not a sorted set")
    r.zadd(layout.index(ns, bucket), {b"\xff" * 64: 1.0, b"not-a-key": 2.0, "0" * 63: 3.0,
                                      stray: 4.0})
    r.zadd(layout.index(ns, "ff"), {"f" * 64: float("inf")})  # never written: STRLEN 0
    for key, size in zip(good, (b"not an integer", b"-5", b"9" * 17), strict=True):
        r.hset(layout.sizes(ns, key[:2]), key, size)


def test_garbage_in_the_index_at_start_neither_stops_a_server_nor_hides_a_chunk(
        redis_server: RedisServer, make_store: MakeStore, make_server: MakeServer,
        tmp_path: Path) -> None:
    tier = redis_tier_dict(redis_server.url)
    writer = make_store(tmp_path / "writer", tiers=[tier])
    writer.rebuild()
    k = keys(3, "garbage at start")
    store_chunks(writer, k)
    settle(writer)
    plant_garbage(plain(redis_server), Layout("kvtier:"), NS.hex(), [key.hex() for key in k])

    server = make_server(tiers=[tier])  # rebuilds from the index on start
    store = store_of(server)
    assert wait_until(lambda: store.lookup(k) == ["shared"] * 3), store.lookup(k)
    assert load(store, k).payloads == expected(k)
    store.check_integrity()


def test_a_scan_lists_every_good_chunk_with_its_real_size_and_counts_the_rest(
        redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    tier = redis_tier(redis_server.url)
    good = [key_of(f"good {i}") for i in range(3)]
    chunks = {key: sealed_chunk(key, seed=i) for i, key in enumerate(good)}
    for key, data in chunks.items():
        tier.write(key, data)
    r = plain(redis_server)
    plant_garbage(r, tier.layout, NAMESPACE.hex(), [key.hex() for key in good])
    caplog.set_level(logging.INFO, logger="kvtier.tiers")

    for _ in range(2):
        listed = {c.key: c for c in tier.scan()}
        assert set(listed) == set(good)
        stored = footprint(len(chunks[good[0]]))
        assert [listed[key].size for key in good] == [stored] * 3, \
            "a size that is no positive integer is asked of the chunk itself"
        assert all(0 < c.mtime < 1e10 for c in listed.values())
    assert tier.namespaces() == [NAMESPACE]
    assert tier.skips.counts["namespace members that are not 64 hex digits"] == 3 * 4
    assert tier.skips.counts["index members that are not 64-hex keys"] == 2 * 3
    assert tier.skips.counts["index members in another key's bucket"] == 2 * 1
    assert tier.skips.counts["sizes that are not positive integers up to the capacity"] == 2 * 3
    assert tier.skips.counts["index keys of another type"] >= 2
    assert tier.skipped_entries == sum(tier.skips.counts.values())
    warnings = [rec for rec in caplog.records
                if rec.levelno == logging.WARNING and "skipping" in rec.getMessage()]
    assert len(warnings) == 5, "one line per kind of garbage, not one per entry or per scan"

    assert tier.reconcile() == 1, "only the entry of a chunk never written is dropped"
    assert {c.key for c in tier.scan()} == set(good)
    for key, data in chunks.items():
        assert read_back(tier, key, len(data)) == data
    r.srem(tier.layout.namespaces, b"\xff", b"not hex", "AB" * 32, "0" * 63)
    caplog.clear()
    list(tier.scan())
    assert any("no more namespace members" in rec.getMessage() for rec in caplog.records)
    tier.close()


def test_keys_of_another_type_list_nothing_and_fail_nothing(redis_server: RedisServer
                                                             ) -> None:
    tier = redis_tier(redis_server.url, key_prefix="typed:")
    key = key_of("typed")
    data = sealed_chunk(key)
    tier.write(key, data)
    tier.put_note("journal/1", b"one")
    r = plain(redis_server)
    ns = NAMESPACE.hex()
    sizes = tier.layout.sizes(ns, key.hex()[:2])
    r.delete(sizes)
    r.lpush(sizes, b"a list, not a hash")
    assert [c.size for c in tier.scan()] == [footprint(len(data))], "sizes from STRLEN"
    for name in (tier.layout.namespaces, tier.layout.notes):
        r.delete(name)
        r.set(name, b"a string")
    assert list(tier.scan()) == [] and tier.namespaces() == []
    assert tier.list_notes("journal/") == []
    assert tier.reconcile() == 0
    chunk = tier.layout.chunk(ns, key.hex())
    r.delete(chunk)
    r.hset(chunk, "field", "a hash where a chunk belongs")
    assert tier.read_into(key, page_buffer(len(data)), namespace=NAMESPACE) is None
    r.delete(tier.layout.note("journal/1"))
    r.hset(tier.layout.note("journal/1"), "field", "a hash where a note belongs")
    assert tier.get_note("journal/1") is None
    assert tier.skips.counts["values of another type"] == 2
    tier.close()


def test_a_huge_value_under_a_chunk_name_is_refused_unread(redis_server: RedisServer
                                                            ) -> None:
    tier = redis_tier(redis_server.url)
    key, good = key_of("huge"), key_of("fine")
    name = tier.layout.chunk(NAMESPACE.hex(), key.hex())
    plain(redis_server).setrange(name, BIG - 1, b"x")  # the server pads it: BIG bytes
    dst = page_buffer(MiB)
    raised, peak = peak_bytes(lambda: tier.read_into(key, dst, namespace=NAMESPACE))
    assert isinstance(raised, ChunkTooLarge), raised
    assert f"{BIG} bytes" in str(raised)
    assert peak < 4 * MiB, f"{peak} bytes held: the value was transferred"
    data = sealed_chunk(good)
    tier.write(good, data)
    assert read_back(tier, good, len(data)) == data, "the connection is still in step"
    tier.close()


def test_a_chunk_exactly_the_size_of_the_buffer_is_read_whole(redis_server: RedisServer
                                                              ) -> None:
    tier = redis_tier(redis_server.url)
    key = key_of("exact")
    data = sealed_chunk(key, SLOT_BYTES - codec.HEADER_SIZE)
    tier.write(key, data)
    dst = page_buffer(len(data))
    assert tier.read_into(key, dst, namespace=NAMESPACE) == len(data)
    assert dst[: len(data)] == data
    with pytest.raises(ChunkTooLarge, match=f"{len(data)} bytes"):
        tier.read_into(key, page_buffer(len(data) - codec.PAGE), namespace=NAMESPACE)
    tier.close()


def test_an_oversized_note_raises_note_too_large_unread(redis_server: RedisServer) -> None:
    tier = redis_tier(redis_server.url)
    r = plain(redis_server)
    r.setrange(tier.layout.note("journal/huge"), BIG - 1, b"x")
    r.zadd(tier.layout.notes, {"journal/huge": 0})
    raised, peak = peak_bytes(lambda: tier.get_note("journal/huge"))
    assert isinstance(raised, NoteTooLarge) and f"{BIG} bytes" in str(raised), raised
    assert peak < 4 * MiB, f"{peak} bytes held: the note was transferred"
    tier.put_note("journal/small", b"x" * 100)
    with pytest.raises(NoteTooLarge):
        tier.get_note("journal/small", max_bytes=99)
    assert tier.get_note("journal/small", max_bytes=100) == b"x" * 100
    tier.put_note("journal/empty", b"")
    assert tier.get_note("journal/empty") == b"", "empty, not missing"
    assert tier.get_note("journal/missing") is None
    assert tier.list_notes("journal/") == ["journal/empty", "journal/huge", "journal/small"]
    tier.close()


def test_list_notes_honours_its_limit_and_leaves_out_invalid_names(redis_server: RedisServer
                                                                   ) -> None:
    tier = redis_tier(redis_server.url)
    valid = [f"journal/{i:03d}" for i in range(25)]
    for name in valid:
        tier.put_note(name, b"n")
    r = plain(redis_server)
    bad: list[bytes | str] = [f"journal/!{i}" for i in range(30)]  # sort before the valid
    bad += [b"journal/\xff", "journal/../escape", "journal/a b", "journal/zz/../x",
            "journal/\u00e9"]
    r.zadd(tier.layout.notes, dict.fromkeys(bad, 0))
    assert tier.list_notes("journal/", limit=10) == valid[:10]
    assert tier.list_notes("journal/", start_after=valid[9], limit=10) == valid[10:20]
    assert tier.list_notes("journal/", start_after=valid[19], limit=10) == valid[20:]
    assert tier.list_notes("journal/") == valid
    assert tier.list_notes("journal/", limit=0) == []
    assert tier.reconcile() == 0, "garbage names are skipped, not read or dropped"
    tier.close()
