"""What every request to the store must satisfy, checked before anything changes."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.codec import HEADER_SIZE, stored_size
from kvtier.errors import InvalidRequest
from kvtier.keys import KEY_BYTES, ChunkKey
from kvtier.policies import check_priority


def check_keys(keys: Sequence[ChunkKey]) -> None:
    """Keys are 32 bytes and distinct within one call."""
    seen: dict[bytes, int] = {}
    for i, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise InvalidRequest(f"keys[{i}]: a chunk key is {KEY_BYTES} bytes, got {len(key)}")
        first = seen.setdefault(key, i)
        if first != i:
            raise InvalidRequest(f"keys[{i}] repeats keys[{first}] ({key.hex()[:16]}...): "
                                 "the keys of one call must be distinct")


def check_priority_of(priority: int) -> None:
    try:
        check_priority(priority)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def check_reserve(namespace_fp: bytes, keys: Sequence[ChunkKey], payload_len: int,
                  tokens: int, priority: int, first_index: int, slot_bytes: int) -> None:
    check_keys(keys)
    check_priority_of(priority)
    if len(namespace_fp) != 32:
        raise InvalidRequest(f"namespace_fp must be 32 bytes, got {len(namespace_fp)}")
    if not 0 < tokens < 2**32 or not 0 <= first_index < 2**32:
        raise InvalidRequest(f"tokens ({tokens}) and first_index ({first_index}) must be "
                             "in [1, 2**32) and [0, 2**32)")
    if payload_len <= 0 or stored_size(payload_len) > slot_bytes:
        raise InvalidRequest(
            f"payload_len {payload_len} does not fit an arena slot of {slot_bytes} bytes "
            f"(at most {slot_bytes - HEADER_SIZE} payload bytes)")
