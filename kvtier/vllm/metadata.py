"""What the scheduler side tells the workers each step, and what they answer.

Plain dataclasses (pickled by vLLM between processes every step), free of vLLM imports so
both sides can be tested without an engine. The facade wraps them in vLLM's metadata types.

The payload of one chunk in an arena slot, for a chunk of ``B = chunk_tokens / block_size``
vLLM blocks, ``L`` layers and tensor-parallel size ``T``::

    payload = [layer 0: [rank 0: page(block 0) .. page(block B-1)] .. [rank T-1: ...]]
              [layer 1: ...] .. [layer L-1: ...]

A page is one vLLM block of one layer on one rank, copied as opaque bytes (its inner layout
is the attention backend's business and is part of the namespace). Each rank writes and
reads only its own pages, so a chunk is complete when every rank has confirmed its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PayloadLayout:
    num_layers: int
    tp_size: int
    blocks_per_chunk: int
    page_bytes: int

    @property
    def payload_len(self) -> int:
        return self.num_layers * self.tp_size * self.blocks_per_chunk * self.page_bytes

    def run_offset(self, layer: int, rank: int) -> int:
        """Byte offset of the run of ``blocks_per_chunk`` pages of (layer, rank)."""
        return (layer * self.tp_size + rank) * self.blocks_per_chunk * self.page_bytes


@dataclass
class LoadJob:
    """Copy leased chunks from arena slots into a request's blocks, then report it done."""

    req_id: str
    arena: str
    """Name of the arena the slots belong to; a worker mapped to another arena fails the job."""
    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    """The slot holding the chunk of each block (parallel to ``block_ids``)."""
    positions: list[int] = field(default_factory=list)
    """Index of each block inside its chunk (0..blocks_per_chunk-1)."""
    failed_block_ids: list[int] = field(default_factory=list)
    """Blocks the scheduler already knows cannot be loaded (vLLM recomputes them)."""


@dataclass
class StoreJob:
    """Copy one full chunk's blocks into a reserved arena slot."""

    key: bytes
    slot: int
    arena: str
    block_ids: list[int]


@dataclass
class StepPlan:
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    flush: list[bytes] = field(default_factory=list)
    """Keys of earlier stores to wait for before this step's forward: vLLM reuses their
    blocks now (see :mod:`kvtier.vllm.fencing`)."""

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.flush)


@dataclass
class WorkerReport:
    """What a worker finished since its last report (merged across workers)."""

    stored: list[bytes] = field(default_factory=list)
    """Keys of chunks whose pages this worker copied into their slots."""
    failed: list[bytes] = field(default_factory=list)
    """Keys of chunks this worker could not copy (the chunk is aborted)."""
    failed_loads: list[str] = field(default_factory=list)
    """Requests whose load job this worker could not run at all (all blocks failed)."""

    def merge(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.stored + other.stored, self.failed + other.failed,
                            self.failed_loads + other.failed_loads)

    def __bool__(self) -> bool:
        return bool(self.stored or self.failed or self.failed_loads)
