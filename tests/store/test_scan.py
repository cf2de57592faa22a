"""What a listing keeps: the newest chunks that fit, handed back oldest first."""

from __future__ import annotations

from kvtier.keys import ChunkKey
from kvtier.store.scan import newest_that_fit
from kvtier.tiers.base import StoredChunk


def chunk(n: int, size: int, mtime: float) -> StoredChunk:
    return StoredChunk(ChunkKey(bytes([n]) * 32), size, mtime, 35, bytes(32))


def test_the_newest_that_fit_are_kept_oldest_first_and_the_rest_left() -> None:
    a, b, c, d = chunk(1, 10, 1.0), chunk(2, 10, 4.0), chunk(3, 30, 3.0), chunk(4, 10, 2.0)
    kept, left = newest_that_fit([a, b, c, d], 25)
    assert kept == [d, b], "oldest first, the order the eviction policy indexes in"
    assert left == [c, a], "too big for what was left, then no room"


def test_everything_fits_or_nothing_does() -> None:
    found = [chunk(1, 5, 2.0), chunk(2, 5, 1.0)]
    assert newest_that_fit(found, 10) == ([found[1], found[0]], [])
    assert newest_that_fit(found, 0) == ([], [found[0], found[1]])
