"""The suite every lower tier passes: subclass :class:`LowerTierConformance`, give it
``make_tier``, and each test below runs against that tier (fsspec's tests/abstract style).

Chunks are sealed with :func:`kvtier.codec.seal` into anonymous mmaps, which are page aligned
like arena slots, so tiers that use O_DIRECT take their fast path here.
"""

from __future__ import annotations

import hashlib
import mmap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kvtier import codec
from kvtier.errors import CorruptChunkError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import LowerTier

NAMESPACE = hashlib.sha256(b"kvtier conformance").digest()


def key_of(label: str) -> ChunkKey:
    return ChunkKey(hashlib.sha256(label.encode()).digest())


def page_buffer(size: int) -> memoryview:
    """A zeroed, page-aligned buffer (the memoryview keeps its mmap alive)."""
    return memoryview(mmap.mmap(-1, max(size, codec.PAGE)))[:size]


def sealed_chunk(key: ChunkKey, payload_len: int = 3 * codec.PAGE + 123, *, seed: int = 0,
                 priority: int = 35) -> memoryview:
    """A page-padded chunk of random payload under ``key``, ready to write."""
    buf = page_buffer(codec.stored_size(payload_len))
    payload = np.random.default_rng(seed).integers(0, 256, payload_len, dtype=np.uint8)
    start = codec.HEADER_SIZE
    np.frombuffer(buf, dtype=np.uint8)[start : start + payload_len] = payload
    codec.seal(buf, NAMESPACE, key, tokens=16, payload_len=payload_len, priority=priority)
    return buf


def read_back(tier: LowerTier, key: ChunkKey, size: int) -> memoryview | None:
    """Read ``key`` into a fresh page-aligned buffer of ``size`` bytes; verify what came."""
    dst = page_buffer(size)
    n = tier.read_into(key, dst, namespace=NAMESPACE)
    if n is None:
        return None
    codec.verify(dst[:n], key, NAMESPACE)
    return dst[:n]


class LowerTierConformance:
    """Mixin; a subclass named ``Test...`` opts a tier in by overriding :meth:`make_tier`."""

    def make_tier(self, tmp_path: Path) -> LowerTier:
        raise NotImplementedError

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[LowerTier]:
        tier = self.make_tier(tmp_path)
        yield tier
        tier.close()

    def test_round_trip(self, tier: LowerTier) -> None:
        key = key_of("round trip")
        data = sealed_chunk(key)
        assert tier.write(key, data) >= len(data)
        got = read_back(tier, key, len(data))
        assert got is not None and got == data

    def test_write_reports_the_footprint_it_promises(self, tier: LowerTier) -> None:
        """The store offers a peer's chunk only if its size in the books is at most
        ``footprint(slot)``: what ``write`` returns must be exactly that footprint."""
        key = key_of("footprint")
        data = sealed_chunk(key)
        assert tier.write(key, data) == tier.footprint(len(data))

    def test_read_into_a_larger_buffer(self, tier: LowerTier) -> None:
        key = key_of("larger buffer")
        data = sealed_chunk(key)
        tier.write(key, data)
        got = read_back(tier, key, len(data) + 5 * codec.PAGE)
        assert got is not None and got == data

    def test_unaligned_buffers_round_trip(self, tier: LowerTier) -> None:
        key = key_of("unaligned")
        data = sealed_chunk(key)
        src = page_buffer(len(data) + codec.PAGE)[1 : 1 + len(data)]  # off the page boundary
        src[:] = data
        tier.write(key, src)
        dst = page_buffer(len(data) + codec.PAGE)[7:]
        n = tier.read_into(key, dst, namespace=NAMESPACE)
        assert n == len(data) and dst[:n] == data

    def test_missing_key_reads_none(self, tier: LowerTier) -> None:
        missing = key_of("never written")
        assert tier.read_into(missing, page_buffer(codec.PAGE), namespace=NAMESPACE) is None

    def test_overwrite_replaces_the_whole_chunk(self, tier: LowerTier) -> None:
        key = key_of("overwrite")
        tier.write(key, sealed_chunk(key, seed=1, priority=10))
        newer = sealed_chunk(key, seed=2, priority=90)
        tier.write(key, newer)
        got = read_back(tier, key, len(newer))
        assert got is not None and got == newer
        assert [c.priority for c in tier.scan()] == [90 if tier.scan_priority else 35]

    def test_readers_never_see_a_partial_overwrite(self, tier: LowerTier) -> None:
        key = key_of("atomic")
        versions = [sealed_chunk(key, 64 * codec.PAGE, seed=s) for s in range(2)]
        tier.write(key, versions[0])
        done = threading.Event()

        def overwrite() -> None:
            try:
                for i in range(40):
                    tier.write(key, versions[i % 2])
            finally:
                done.set()

        writer = threading.Thread(target=overwrite)
        writer.start()
        reads = 0
        try:
            while not done.is_set() or reads < 10:
                got = read_back(tier, key, len(versions[0]))  # verify() raises on a torn chunk
                # A shared volume may show no file for an instant of a rename: a miss, fine.
                assert got in versions or (got is None and tier.shared)
                reads += 1
        finally:
            writer.join()

    def test_delete_is_idempotent(self, tier: LowerTier) -> None:
        key = key_of("delete")
        data = sealed_chunk(key)
        tier.write(key, data)
        tier.delete(key, namespace=NAMESPACE)
        assert tier.read_into(key, page_buffer(len(data)), namespace=NAMESPACE) is None
        tier.delete(key, namespace=NAMESPACE)
        tier.delete(key_of("never written"), namespace=NAMESPACE)
        assert list(tier.scan()) == []

    def test_quarantine_makes_a_key_unreadable(self, tier: LowerTier) -> None:
        key, kept = key_of("bad"), key_of("good")
        tier.write(key, sealed_chunk(key))
        tier.write(kept, sealed_chunk(kept))
        tier.quarantine(key, namespace=NAMESPACE)
        assert tier.read_into(key, page_buffer(64 * codec.PAGE), namespace=NAMESPACE) is None
        assert [c.key for c in tier.scan()] == [kept]
        tier.quarantine(key, namespace=NAMESPACE)
        tier.quarantine(key_of("never written"), namespace=NAMESPACE)

    def test_scan_lists_exactly_what_was_written(self, tier: LowerTier) -> None:
        assert list(tier.scan()) == []
        expected: dict[ChunkKey, tuple[int, int]] = {}
        for i in range(6):
            key = key_of(f"scan {i}")
            data = sealed_chunk(key, (i + 1) * codec.PAGE - i, seed=i, priority=10 * i)
            expected[key] = (tier.write(key, data), 10 * i)
        tier.delete(key_of("scan 0"), namespace=NAMESPACE)
        del expected[key_of("scan 0")]
        found = {c.key: (c.size, c.priority) for c in tier.scan()}
        if not tier.scan_priority:
            expected = {k: (size, 35) for k, (size, _p) in expected.items()}
        assert found == expected
        assert {c.namespace for c in tier.scan()} == {NAMESPACE}
        assert all(c.mtime > 0 for c in tier.scan())

    def test_too_small_a_buffer_is_corrupt(self, tier: LowerTier) -> None:
        key = key_of("too small")
        data = sealed_chunk(key)
        tier.write(key, data)
        with pytest.raises(CorruptChunkError):
            tier.read_into(key, page_buffer(len(data) - codec.PAGE), namespace=NAMESPACE)

    def test_concurrent_writers_and_readers(self, tier: LowerTier) -> None:
        def work(thread: int) -> None:
            for i in range(8):
                key = key_of(f"thread {thread} chunk {i}")
                data = sealed_chunk(key, (i + 1) * 5000, seed=thread * 100 + i)
                tier.write(key, data)
                got = read_back(tier, key, len(data))
                assert got is not None and got == data

        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(work, range(8)))
        assert len(list(tier.scan())) == 64

    def test_describe_names_the_tier(self, tier: LowerTier) -> None:
        facts = tier.describe()
        assert facts["name"] == tier.name and facts["type"] == tier.config.type
