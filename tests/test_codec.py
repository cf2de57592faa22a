"""The stored chunk format: a torn, foreign or bit-flipped chunk never verifies."""

from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash

from kvtier.codec import (
    HEADER_SIZE,
    MAGIC,
    USED_HEADER_BYTES,
    ChunkHeader,
    seal,
    stored_size,
    verify,
)
from kvtier.errors import CorruptChunkError
from kvtier.keys import ChunkKey

NS = hashlib.sha256(b"namespace").digest()
KEY = ChunkKey(hashlib.sha256(b"chunk").digest())
PAYLOAD = 5000  # not a multiple of the page size, so there is padding after it


def sealed(payload_len: int = PAYLOAD, key: ChunkKey = KEY) -> memoryview:
    """A slot-sized buffer with a patterned payload, sealed as ``key``."""
    buf = memoryview(bytearray(stored_size(payload_len)))
    buf[HEADER_SIZE : HEADER_SIZE + payload_len] = bytes(i % 251 for i in range(payload_len))
    seal(buf, NS, key, tokens=256, payload_len=payload_len, priority=80)
    return buf


def resign(buf: memoryview) -> None:
    """Recompute the header checksum, as a foreign writer with its own format would."""
    checked = USED_HEADER_BYTES - 8
    struct.pack_into("<Q", buf, checked, xxhash.xxh3_64_intdigest(bytes(buf[:checked])))


@pytest.mark.parametrize(
    ("payload_len", "size"), [(0, 4096), (1, 8192), (4096, 8192), (4097, 12288)]
)
def test_stored_size_is_one_header_page_plus_the_page_padded_payload(
    payload_len: int, size: int
) -> None:
    assert stored_size(payload_len) == size


@pytest.mark.parametrize("payload_len", [0, 1, PAYLOAD, 8192])
def test_seal_then_verify_round_trips(payload_len: int) -> None:
    buf = sealed(payload_len)
    header = verify(buf, KEY, NS)
    assert header == ChunkHeader.unpack(buf)
    assert (header.key, header.namespace_fp) == (KEY, NS)
    assert (header.tokens, header.payload_len, header.priority) == (256, payload_len, 80)
    assert bytes(buf[:4]) == MAGIC


def test_verify_without_a_namespace_checks_everything_else() -> None:
    assert verify(sealed(), KEY).payload_len == PAYLOAD


def test_every_single_bit_flip_in_the_header_is_caught() -> None:
    buf = sealed()
    for bit in range(USED_HEADER_BYTES * 8):
        buf[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptChunkError):
            verify(buf, KEY, NS)
        buf[bit // 8] ^= 1 << (bit % 8)
    verify(buf, KEY, NS)  # every flip was undone: the chunk is intact again


@pytest.mark.parametrize("offset", [0, PAYLOAD // 2, PAYLOAD - 1])
def test_a_flipped_payload_bit_is_caught(offset: int) -> None:
    buf = sealed()
    buf[HEADER_SIZE + offset] ^= 0x10
    with pytest.raises(CorruptChunkError, match="payload checksum mismatch"):
        verify(buf, KEY, NS)


def test_a_truncated_payload_is_caught() -> None:
    buf = sealed()
    with pytest.raises(CorruptChunkError, match="payload truncated"):
        verify(buf[: HEADER_SIZE + PAYLOAD - 1], KEY, NS)


def test_a_truncated_header_is_caught() -> None:
    with pytest.raises(CorruptChunkError, match="header truncated"):
        verify(sealed()[: USED_HEADER_BYTES - 1], KEY, NS)


def test_an_empty_buffer_is_caught() -> None:
    with pytest.raises(CorruptChunkError):
        verify(memoryview(bytearray(stored_size(PAYLOAD))), KEY, NS)


def test_a_chunk_stored_under_another_key_is_caught() -> None:
    other = ChunkKey(hashlib.sha256(b"other").digest())
    with pytest.raises(CorruptChunkError, match="different key"):
        verify(sealed(), other, NS)


def test_a_chunk_from_another_namespace_is_caught() -> None:
    with pytest.raises(CorruptChunkError, match="different namespace"):
        verify(sealed(), KEY, hashlib.sha256(b"other").digest())


def test_foreign_magic_is_caught_even_with_a_valid_header_checksum() -> None:
    buf = sealed()
    buf[:4] = b"GGUF"
    resign(buf)
    with pytest.raises(CorruptChunkError, match="bad magic"):
        verify(buf, KEY, NS)


def test_another_format_version_is_caught() -> None:
    buf = sealed()
    struct.pack_into("<H", buf, 4, 99)
    resign(buf)
    with pytest.raises(CorruptChunkError, match="format version 99"):
        verify(buf, KEY, NS)
