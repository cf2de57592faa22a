"""Copying KV pages between vLLM's cache tensors and arena slots.

vLLM hands the worker one tensor per attention layer (views into one allocation). Each is
turned into a ``uint8 [num_blocks, page_bytes]`` view: row ``b`` is block ``b``'s page for that
layer, whatever the attention backend's inner layout (pages are copied as opaque bytes, see
:mod:`kvtier.vllm.metadata` for their order in a chunk payload).

- :class:`CpuCopier` (vLLM's CPU build): the "device" cache is host memory, so a copy is a
  memcpy (``index_select`` / ``index_copy_``), done synchronously: a store has finished reading
  its blocks before ``wait_for_save`` returns, so vLLM may reuse them at once.
- :class:`CudaCopier`: the arena is registered as pinned memory (``cudaHostRegister``) so
  copies are real DMA, issued on a side stream after the step's forward, with an event per
  batch. The worker waits on pending store events before the next step's forward
  (``handle_preemptions``), so no block is overwritten while a copy still reads it. **This
  path is written against the documented CUDA/torch APIs but has not been run (no GPU was
  available); treat it as unverified.**
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.vllm.metadata import PayloadLayout

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def page_views(kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
               page_bytes: int) -> list[torch.Tensor]:
    """One ``uint8 [num_blocks, page_bytes]`` view per distinct layer cache, in layer order.

    Layers that share a cache (same memory) appear once. Raises ValueError when a page is
    not one contiguous run of bytes (a layout this connector does not handle).
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    views: list[tuple[tuple[int, str], torch.Tensor]] = []
    for name, tensor in kv_caches.items():
        ident = (tensor.data_ptr(), tuple(tensor.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        views.append((_layer_order(name), _page_view(tensor, num_blocks, page_bytes)))
    views.sort(key=lambda item: item[0])
    return [view for _, view in views]


def _layer_order(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)


def _page_view(tensor: torch.Tensor, num_blocks: int, page_bytes: int) -> torch.Tensor:
    elem = tensor.element_size()
    rows = tensor.shape[0]
    if rows % num_blocks:
        raise ValueError(f"KV tensor of {rows} rows is not a multiple of {num_blocks} blocks")
    ratio = rows // num_blocks  # kernel blocks per scheduler block (GPU backends)
    inner = tensor[0]
    if ratio * inner.numel() * elem != page_bytes or not _dense(inner):
        raise ValueError(
            f"KV tensor {tuple(tensor.shape)} stride {tensor.stride()}: a block's page is not "
            f"{page_bytes} contiguous bytes")
    if ratio > 1 and tensor.stride(0) * elem != inner.numel() * elem:
        raise ValueError("kernel blocks of one scheduler block are not adjacent in memory")
    row_stride = tensor.stride(0) * elem * ratio
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(tensor.untyped_storage(), tensor.storage_offset() * elem,
              (num_blocks, page_bytes), (row_stride, 1))
    return flat


def payload_runs(payload: np.ndarray, layout: PayloadLayout, rank: int,
                 num_layers: int) -> list[torch.Tensor]:
    """Per layer, this rank's ``[blocks_per_chunk, page_bytes]`` run inside a payload."""
    size = layout.blocks_per_chunk * layout.page_bytes
    host = torch.from_numpy(payload)
    return [host[off : off + size].view(layout.blocks_per_chunk, layout.page_bytes)
            for off in (layout.run_offset(layer, rank) for layer in range(num_layers))]


def _dense(t: torch.Tensor) -> bool:
    """True if ``t`` fills one gap-free run of memory, in any dimension order.

    A block's page must be such a run; its logical view may be permuted (FlashAttention's
    ``[B, H, N, 2D]`` view of a ``[B, N, H, 2D]`` cache), since pages are copied as bytes.
    """
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


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

    def __init__(self, pages: list[torch.Tensor], layout: PayloadLayout, rank: int) -> None:
        self.pages = [p.numpy() for p in pages]
        self.layout = layout
        self.rank = rank

    def attach(self, arena: np.ndarray) -> None:
        """Nothing to do on CPU: arena memory is used as it is."""

    def detach(self) -> None:
        """Nothing to undo on CPU."""

    def _runs(self, payload: np.ndarray) -> list[np.ndarray]:
        lay = self.layout
        size = lay.blocks_per_chunk * lay.page_bytes
        return [payload[off : off + size].reshape(lay.blocks_per_chunk, lay.page_bytes)
                for off in (lay.run_offset(layer, self.rank) for layer in range(len(self.pages)))]

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


class CudaCopier:
    """Asynchronous copies between GPU KV pages and a pinned (host-registered) arena.

    UNVERIFIED: no GPU was available when this was written. Each ``store``/``load`` call
    enqueues its copies on a side stream (after the work already queued on the current
    stream, i.e. the step's forward) and returns an event; the caller reports completion
    only once ``event.query()`` is true and must not let vLLM reuse the blocks before that
    (the worker synchronizes pending stores in ``handle_preemptions``).
    """

    synchronous = False

    def __init__(self, pages: list[torch.Tensor], layout: PayloadLayout, rank: int,
                 device: torch.device) -> None:
        self.pages = pages
        self.layout = layout
        self.rank = rank
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._registered: tuple[int, int] | None = None
        self._keep: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []

    def attach(self, arena: np.ndarray) -> None:
        """Pin the arena mapping once (again when the server restarted with a new arena)."""
        span = (arena.ctypes.data, arena.nbytes)
        self.detach()  # the caller attaches only a new mapping: never trust an old span
        rc = torch.cuda.cudart().cudaHostRegister(span[0], span[1], 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of the kvtier arena failed (error {int(rc)})")
        self._registered = span

    def detach(self) -> None:
        if self._registered is None:
            return
        self.synchronize()
        torch.cuda.cudart().cudaHostUnregister(self._registered[0])
        self._registered = None

    def _runs(self, payload: np.ndarray) -> list[torch.Tensor]:
        return payload_runs(payload, self.layout, self.rank, len(self.pages))

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long).to(self.device)

    def store(self, chunks: Sequence[ChunkCopy]) -> torch.cuda.Event:
        lay = self.layout
        keep: list[torch.Tensor] = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for chunk in chunks:
                idx = self._index(chunk.block_ids)
                staging = torch.empty((len(self.pages), lay.blocks_per_chunk, lay.page_bytes),
                                      dtype=torch.uint8, device=self.device)
                for layer, pages in enumerate(self.pages):
                    torch.index_select(pages, 0, idx, out=staging[layer])
                for layer, run in enumerate(self._runs(chunk.payload)):
                    run.copy_(staging[layer], non_blocking=True)
                keep += [idx, staging]
        return self._record(keep)

    def load(self, chunks: Sequence[ChunkCopy]) -> torch.cuda.Event:
        lay = self.layout
        keep: list[torch.Tensor] = []
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for chunk in chunks:
                idx, pos = self._index(chunk.block_ids), self._index(chunk.positions)
                staging = torch.empty((len(self.pages), lay.blocks_per_chunk, lay.page_bytes),
                                      dtype=torch.uint8, device=self.device)
                for layer, run in enumerate(self._runs(chunk.payload)):
                    staging[layer].copy_(run, non_blocking=True)
                for layer, pages in enumerate(self.pages):
                    pages.index_copy_(0, idx, staging[layer].index_select(0, pos))
                keep += [idx, pos, staging]
        return self._record(keep)

    def _record(self, keep: list[torch.Tensor]) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.stream)
        # Staging buffers must outlive the copies that use them.
        self._keep = [(e, k) for e, k in self._keep if not e.query()]
        self._keep.append((event, keep))
        return event

    def synchronize(self) -> None:
        self.stream.synchronize()
        self._keep.clear()
