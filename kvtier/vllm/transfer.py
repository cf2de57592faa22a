"""Copying KV pages between vLLM's cache tensors and arena slots: the two paths.

vLLM hands the worker one tensor per attention layer (views into one allocation).
:func:`kvtier.vllm.pages.page_views` turns each into ``uint8 [num_blocks, runs, run_bytes]``:
block ``b``'s page for that layer is its runs in address order (one run for the layouts vLLM
uses by default, one per KV head or K/V for the others; see :mod:`kvtier.vllm.pages`), copied
as opaque bytes (:mod:`kvtier.vllm.metadata` gives their order in a chunk payload). Both
paths produce the same payload bytes for the same layout.

- :class:`CpuCopier` (vLLM's CPU build): the "device" cache is host memory, so a copy is a
  memcpy per page (numpy), done synchronously: a store has finished reading its blocks
  before ``wait_for_save`` returns, so vLLM may reuse them at once.
- :class:`~kvtier.vllm.cuda_copier.CudaCopier` (GPU): the arena is registered as pinned
  memory (with a pageable fallback, :mod:`kvtier.vllm.pinning`); each call gathers a chunk's
  pages into a bounded, reused staging buffer on a side stream and moves them with one DMA
  (scatter for loads), after the work already queued on the current stream, and returns an
  event. The worker reports a copy once its event completed, and waits for a pending store
  only when the scheduler side says vLLM is about to reuse its blocks
  (``handle_preemptions``, :mod:`kvtier.vllm.fencing`), so a step's stores overlap the next
  step's forward. The index and layout logic runs in the tests on CPU tensors laid out as
  each CUDA backend lays them out; the CUDA calls themselves are checked only by
  ``kvtier bench gpu`` on a GPU (docs/vllm.md says what has been measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.vllm.metadata import PayloadLayout


@dataclass(frozen=True)
class ChunkCopy:
    """One chunk's part of a transfer: blocks of one request and the slot's payload."""

    payload: np.ndarray
    """uint8 view of the slot's payload region (``layout.payload_len`` bytes)."""
    block_ids: Sequence[int]
    positions: Sequence[int]
    """Index of each block inside the chunk (all of 0..B-1 for a store)."""


class CpuCopier:
    """Synchronous memcpy between host-resident KV pages and arena payloads.

    Copies go through numpy, one ``copyto`` per page: several times faster here than
    torch's ``index_copy_`` (no per-call dispatch, no OpenMP fan-out for small copies).
    """

    synchronous = True

    def __init__(self, pages: Sequence[torch.Tensor], layout: PayloadLayout, rank: int) -> None:
        self.pages = [p.numpy() for p in pages]
        self.layout = layout
        self.rank = rank

    def attach(self, arena: np.ndarray) -> None:
        """Nothing to do on CPU: arena memory is used as it is."""

    def detach(self) -> None:
        """Nothing to undo on CPU."""

    def _runs(self, payload: np.ndarray) -> list[np.ndarray]:
        """Per layer, this rank's ``[blocks_per_chunk, runs, run_bytes]`` part of a payload."""
        lay = self.layout
        size = lay.blocks_per_chunk * lay.page_bytes
        return [payload[off : off + size].reshape(lay.blocks_per_chunk, *pages.shape[1:])
                for pages, off in zip(self.pages, (lay.run_offset(layer, self.rank)
                                                   for layer in range(len(self.pages))),
                                      strict=True)]

    def store(self, chunks: Sequence[ChunkCopy]) -> None:
        for chunk in chunks:
            for pages, run in zip(self.pages, self._runs(chunk.payload), strict=True):
                for pos, block in zip(chunk.positions, chunk.block_ids, strict=True):
                    np.copyto(run[pos], pages[block])

    def load(self, chunks: Sequence[ChunkCopy]) -> None:
        for chunk in chunks:
            for pages, run in zip(self.pages, self._runs(chunk.payload), strict=True):
                for pos, block in zip(chunk.positions, chunk.block_ids, strict=True):
                    np.copyto(pages[block], run[pos])

    def synchronize(self) -> None:
        """Every copy already finished when its call returned."""
