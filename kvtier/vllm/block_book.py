"""Which vLLM blocks each kvtier chunk holds, for the engine's KV-event stream.

kvtier names a chunk by its own key (a sha256 chain over 256 tokens in a namespace); vLLM's
event consumers name blocks by vLLM's block hashes (``request.block_hashes``: one per
vLLM block, 128 tokens on CPU, 16 on CUDA). The scheduler side writes down, for each chunk it
stores or loads, the hashes of the blocks in it, the hash of the block before it and its
tokens, while the request that has them is alive; the event feed reads them back when the
node server reports the chunk stored in, or removed from, a tier — possibly long after the
request finished.

The book is bounded (least recently written down first out): a chunk forgotten here is a
chunk whose later events cannot be translated (they are skipped and counted). Each entry
also keeps the tiers its chunk was announced in, so a resynchronisation can take back
exactly what was announced.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey


@dataclass(slots=True)
class ChunkBlocks:
    hashes: tuple[bytes, ...]
    """vLLM's block hashes of the chunk's blocks, in order."""
    parent: bytes | None
    """The hash of the block before the chunk (None for a prompt's first chunk)."""
    tokens: array[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    held: set[str] = field(default_factory=set)
    """Tiers the chunk was announced in (stored, not removed since)."""


class BlockBook:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._chunks: OrderedDict[ChunkKey, ChunkBlocks] = OrderedDict()
        self.forgotten_held = 0
        """Entries dropped for room while a tier still held them (their removal will be
        skipped: a consumer keeps them until it resynchronises)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: object) -> bool:
        return key in self._chunks

    def write(self, key: ChunkKey, blocks: ChunkBlocks) -> None:
        """Remember ``key``'s blocks (again: freshest last); keeps what it was announced in."""
        old = self._chunks.pop(key, None)
        if old is not None:
            blocks.held |= old.held
        self._chunks[key] = blocks
        while len(self._chunks) > self.capacity:
            _, dropped = self._chunks.popitem(last=False)
            self.forgotten_held += bool(dropped.held)

    def get(self, key: ChunkKey) -> ChunkBlocks | None:
        return self._chunks.get(key)

    def held(self) -> Iterator[tuple[ChunkKey, ChunkBlocks]]:
        """Every entry announced in at least one tier."""
        return ((k, b) for k, b in list(self._chunks.items()) if b.held)

    def clear(self) -> None:
        self._chunks.clear()
