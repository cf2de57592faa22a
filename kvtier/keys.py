"""Chunk identity: chained content hashes rooted in a namespace fingerprint.

A prompt is cut into fixed chunks of ``chunk_tokens`` tokens; only full chunks get keys.
Chunk *i*'s key is ``sha256(key[i-1] || tokens of chunk i)`` and the chain starts at a root
derived from the namespace fingerprint and the request's extras (cache salt, adapter). One key
therefore names a whole prefix, two processes or machines compute the same keys for the same
prefix, and a different model, dtype, KV layout, rank or format can never match::

    root   = sha256(b"kvtier-root" || namespace.fingerprint || sha256(extras))
    key[0] = sha256(root   || int32le(tokens[0:C]))
    key[i] = sha256(key[i-1] || int32le(tokens[i*C:(i+1)*C]))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import NewType

import numpy as np

from kvtier.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
"""32 raw bytes. Shown as lowercase hex (64 characters) in paths, object names and logs."""

KEY_BYTES = 32
FORMAT_VERSION = 1
"""Bumped whenever the stored chunk layout changes; part of every namespace fingerprint."""


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a chunk for the same tokens.

    ``model`` is a name or path; ``model_digest`` a digest of the model's config and weights
    index (see :func:`kvtier.layout.model_digest`), so a new checkpoint under the same path
    gets a new namespace.
    """

    model: str
    model_digest: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str
    chunk_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    format_version: int = FORMAT_VERSION
    extra: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"namespace.{name} must be a positive integer")
        if self.chunk_tokens % self.block_size:
            raise ConfigError(
                f"namespace.chunk_tokens ({self.chunk_tokens}) must be a multiple of "
                f"block_size ({self.block_size})"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"namespace.tp_rank must be in [0, tp_size={self.tp_size})")

    @cached_property
    def fingerprint(self) -> bytes:
        """sha256 of the canonical JSON of every field (32 bytes)."""
        doc = asdict(self)
        doc["extra"] = dict(sorted(self.extra.items()))
        text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()

    @property
    def short(self) -> str:
        """16 hex characters of the fingerprint, for logs, metrics labels and folder names."""
        return self.fingerprint.hex()[:16]


def root_key(namespace_fp: bytes, extras: Sequence[str | bytes] = ()) -> bytes:
    """The chain's root for one namespace and one set of extras (cache salt, adapter)."""
    h = hashlib.sha256()
    for item in extras:
        raw = item.encode() if isinstance(item, str) else item
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return hashlib.sha256(b"kvtier-root" + namespace_fp + h.digest()).digest()


def chunk_keys(
    namespace_fp: bytes,
    tokens: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    extras: Sequence[str | bytes] = (),
    *,
    start: int = 0,
    parent: bytes | None = None,
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens``.

    ``start``/``parent`` resume a chain: pass the index of the first chunk to hash and the key
    of the chunk before it (``None`` for the root), so a growing request hashes only its new
    chunks.
    """
    if chunk_tokens <= 0:
        raise ConfigError("chunk_tokens must be a positive integer")
    arr = np.asarray(tokens, dtype="<i4")
    count = len(arr) // chunk_tokens
    prev = parent if parent is not None else root_key(namespace_fp, extras)
    if start and parent is None:
        raise ValueError("resuming a chain at start > 0 needs the parent key")
    keys: list[ChunkKey] = []
    raw = np.ascontiguousarray(arr[: count * chunk_tokens]).data.cast("B")
    step = chunk_tokens * 4
    for i in range(start, count):
        h = hashlib.sha256(prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        keys.append(ChunkKey(prev))
    return keys


def parse_key(text: str) -> ChunkKey:
    """A key from its 64-character hex form; raises ValueError on anything else."""
    if len(text) != 2 * KEY_BYTES:
        raise ValueError(f"a chunk key is {2 * KEY_BYTES} hex characters, got {len(text)}")
    return ChunkKey(bytes.fromhex(text))
