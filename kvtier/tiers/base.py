"""The contract of a storage tier below the arena (disk, and the shared fs, s3, redis).

A lower tier stores whole chunks in the stored format of :mod:`kvtier.codec` (header page +
payload, page padded) under their key. It is *only* storage: which chunks it holds, its
capacity, eviction and admission are the store's bookkeeping (:mod:`kvtier.store`), so every
tier gets the same policies and the same accounting.

Data never passes through Python ``bytes``: writes take a memoryview of an arena slot, reads
land in one. Every method may be called from the store's I/O threads concurrently, for
different keys; the store never writes and deletes the same key at once.

Chunks are named by namespace and key (a shared tier keeps each namespace apart, so its
usage can be listed and budgeted per namespace); a write finds both in the chunk's header.

Errors: a missing chunk is a return value (``None``). Failures of the backing store raise
:class:`~kvtier.errors.TierIOError` (or a subclass) *from* the original exception. Checksums
are verified by the store, not here. Calls may block (a hung mount): the store bounds them
with its own timeout (``io_timeout_s``) and never calls a tier under its lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.config import TierConfig
from kvtier.keys import ChunkKey


@dataclass(frozen=True)
class StoredChunk:
    """One chunk found by :meth:`LowerTier.scan` when rebuilding the index."""

    key: ChunkKey
    size: int
    """Bytes the chunk occupies in the tier (what counts against capacity)."""
    mtime: float
    """Last write time; rebuilds insert chunks into the eviction policy oldest first."""
    priority: int
    namespace: bytes
    """The namespace fingerprint the chunk belongs to (32 bytes)."""


@dataclass(frozen=True)
class Space:
    """Room on a tier's backing filesystem (``statvfs``), for capacity learning."""

    free: int
    """Bytes this process may still write."""
    total: int


class LowerTier(ABC):
    """Chunk storage keyed by :data:`~kvtier.keys.ChunkKey`."""

    shared: ClassVar[bool] = False
    """Other servers write and delete here too (:class:`~kvtier.tiers.shared.SharedTier`)."""
    scan_priority: ClassVar[bool] = True
    """``scan`` reports each chunk's stored priority (shared tiers list names only: 35)."""

    def __init__(self, name: str, config: TierConfig) -> None:
        self.name = name
        self.config = config

    @classmethod
    def from_config(cls, name: str, config: TierConfig) -> LowerTier:
        """Build the tier; raises ConfigError for bad ``config.options``."""
        return cls(name, config)

    @abstractmethod
    def write(self, key: ChunkKey, data: memoryview) -> int:
        """Store ``data`` (a sealed chunk, page padded) under ``key`` atomically.

        Readers never see a partial chunk: either the old state or the whole new one.
        Returns the bytes the chunk now occupies. Raises TierIOError (TierFull when the
        backing store is out of space).
        """

    @abstractmethod
    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        """Read the chunk stored under ``key`` into the start of ``dst``.

        Returns the number of bytes read, or ``None`` if the tier does not hold ``key``.
        A chunk larger than ``dst`` raises ChunkTooLarge (not this reader's chunk size; no
        proof of corruption). Raises TierIOError.
        """

    @abstractmethod
    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        """Remove ``key``; a missing key is not an error. Raises TierIOError."""

    @abstractmethod
    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        """Move a chunk that failed verification out of the way (kept for inspection,
        never served again). A missing key is not an error."""

    @abstractmethod
    def scan(self) -> Iterator[StoredChunk]:
        """Every chunk the tier holds, for rebuilding the index after a restart. Cleans up
        leftovers of interrupted writes on the way."""

    def footprint(self, nbytes: int) -> int:
        """What a chunk of ``nbytes`` (sealed, page padded) counts for in this tier's books:
        the size :meth:`write` returns for it. The bytes themselves, unless the backend
        accounts more (Redis: allocator classes and per-key overhead)."""
        return nbytes

    def space(self) -> Space | None:
        """Room left on the backing filesystem, or ``None`` where that is not a question
        (object stores: their budget is kvtier's ``capacity_bytes``)."""
        return None

    def describe(self) -> dict[str, Any]:
        """Static facts for the admin view and logs (never secrets)."""
        return {"type": self.config.type, "name": self.name}

    def close(self) -> None:  # noqa: B027 - an optional hook, a no-op unless overridden
        """Release resources; the tier is not used afterwards."""
