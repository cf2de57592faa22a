"""Chunk keys: chained content hashes that every process computes the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, Namespace, chunk_keys, parse_key

C = 16  # tokens per chunk in these tests


def namespace(**changes: Any) -> Namespace:
    base = Namespace(
        model="tiny-llama",
        model_digest="d1",
        dtype="bfloat16",
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        kv_layout="nhd",
        chunk_tokens=C,
    )
    return replace(base, **changes)


FP = namespace().fingerprint
TOKENS = list(range(1000, 1000 + 5 * C))  # five full chunks


def keys(tokens: list[int] = TOKENS, extras: tuple[str, ...] = ()) -> list[bytes]:
    return list(chunk_keys(FP, tokens, C, extras))


SUBPROCESS = """
from kvtier.keys import Namespace, chunk_keys
ns = Namespace(model="tiny-llama", model_digest="d1", dtype="bfloat16", num_layers=4,
               num_kv_heads=2, head_dim=64, block_size=16, kv_layout="nhd", chunk_tokens=16)
print(" ".join(k.hex() for k in chunk_keys(ns.fingerprint, list(range(1000, 1080)), 16)))
"""


def test_keys_are_identical_in_another_process() -> None:
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # hash() differs; the keys must not
    out = subprocess.run(
        [sys.executable, "-c", SUBPROCESS], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [key.hex() for key in keys()]


def test_a_key_is_32_bytes_and_round_trips_through_hex() -> None:
    first = keys()[0]
    assert len(first) == KEY_BYTES == 32
    assert parse_key(first.hex()) == first


@pytest.mark.parametrize("bad", ["ab", "zz" * 32, "0" * 65])
def test_parse_key_rejects_anything_but_64_hex_characters(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_key(bad)


def test_changing_the_first_token_changes_every_key() -> None:
    changed = keys([TOKENS[0] + 1, *TOKENS[1:]])
    assert all(a != b for a, b in zip(keys(), changed, strict=True))


def test_changing_chunk_3_keeps_the_keys_before_it() -> None:
    tokens = list(TOKENS)
    tokens[3 * C + 5] += 1
    before, after = keys(), keys(tokens)
    assert after[:3] == before[:3]
    assert all(a != b for a, b in zip(before[3:], after[3:], strict=True))


def test_only_full_chunks_get_keys() -> None:
    assert len(keys(TOKENS[: 2 * C + C // 2])) == 2
    assert keys(TOKENS[: C - 1]) == []
    assert keys(TOKENS[: 3 * C]) == keys()[:3]


def test_numpy_tokens_give_the_same_keys() -> None:
    assert list(chunk_keys(FP, np.array(TOKENS, dtype=np.int64), C)) == keys()


def test_extras_change_every_key() -> None:
    salted = keys(extras=("tenant-a",))
    assert all(a != b for a, b in zip(keys(), salted, strict=True))
    assert keys(extras=("tenant-b",))[0] != salted[0]
    assert list(chunk_keys(FP, TOKENS, C, [b"tenant-a"])) == salted  # str and bytes agree


def test_extras_are_length_prefixed() -> None:
    assert keys(extras=("ab", "c")) != keys(extras=("a", "bc"))


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"tp_rank": 1, "tp_size": 2},
        {"tp_size": 2},
        {"chunk_tokens": 32},
        {"model_digest": "d2"},
        {"model": "other"},
        {"num_layers": 5},
        {"kv_layout": "hnd"},
        {"format_version": 2},
        {"extra": {"lora": "x"}},
    ],
)
def test_every_namespace_field_changes_the_fingerprint(change: dict[str, Any]) -> None:
    other = namespace(**change)
    assert other.fingerprint != FP
    assert chunk_keys(other.fingerprint, TOKENS, C)[0] != keys()[0]


def test_the_fingerprint_ignores_the_order_of_extra_fields() -> None:
    one = namespace(extra={"a": "1", "b": "2"})
    two = namespace(extra={"b": "2", "a": "1"})
    assert one.fingerprint == two.fingerprint
    assert len(one.fingerprint) == 32
    assert one.short == one.fingerprint.hex()[:16]


def test_resuming_a_chain_gives_the_same_keys() -> None:
    whole = keys()
    head = keys(TOKENS[: 2 * C])
    tail = chunk_keys(FP, TOKENS, C, start=2, parent=head[-1])
    assert head + tail == whole
    assert chunk_keys(FP, TOKENS, C, start=5, parent=whole[-1]) == []


def test_resuming_without_a_parent_is_an_error() -> None:
    with pytest.raises(ValueError, match="parent"):
        chunk_keys(FP, TOKENS, C, start=2)


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        chunk_keys(FP, TOKENS, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_layers": 0}, "namespace.num_layers must be a positive integer"),
        ({"head_dim": -1}, "namespace.head_dim must be a positive integer"),
        ({"chunk_tokens": 24}, r"namespace.chunk_tokens \(24\) must be a multiple of block_size"),
        ({"tp_rank": 2, "tp_size": 2}, r"namespace.tp_rank must be in \[0, tp_size=2\)"),
        ({"tp_rank": -1}, "namespace.tp_rank"),
    ],
)
def test_namespace_validation(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        namespace(**change)
