"""The CUDA copy path: KV pages <-> arena slots through one bounded, reused staging buffer.

Why staging at all: the pages of a chunk are scattered over the KV cache (one per layer and
block, 64 KiB for a typical 8-KV-head bf16 model with 16-token blocks), and with plain torch
each copy is a separate call of ~5-10 us of host time. Copying them one by one
(``tensor.copy_`` per page, ~1300 calls for one 256-token chunk of an 80-layer model) costs
more host time than the PCIe transfer itself. Instead, one gather kernel per
(chunk, :class:`~kvtier.vllm.pages.LayerStack`) collects a chunk's pages into a device
buffer in payload order, and one DMA moves them to the arena slot (per layer with tensor
parallelism, since each rank's run of a layer is apart from the next). Loads do the reverse
(DMA in, one scatter kernel). See :mod:`kvtier.vllm.fills` for how a call is cut into fills.

The staging buffer is allocated once, when the worker registers the KV caches, and holds
at most one chunk of one rank (default cap :data:`STAGING_CAP` = 32 MiB; at least one layer of
one chunk): a fixed amount, not per chunk or per step. vLLM sizes its KV cache before the
connector exists, so this memory comes out of the headroom vLLM leaves
(``1 - gpu_memory_utilization``); the only other allocations are the int64 block-id tensors
of a call (8 bytes per block).

All work runs on one :class:`~kvtier.vllm.lanes.Lane` (a CUDA side stream) in issue order, so
a fill reuses the buffer right after the previous fill's copies, loads never overtake
earlier stores of the same blocks, and the host never waits: ``store``/``load`` return an
event, the worker reports the copy once the event completed, and waits on a store's event
only when vLLM is about to reuse its blocks (:mod:`kvtier.vllm.fencing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.vllm.fills import Fill, Piece, StackSpan, plan_fills, staging_bytes
from kvtier.vllm.lanes import CopyEvent, Lane
from kvtier.vllm.metadata import PayloadLayout
from kvtier.vllm.pages import LayerStack, layer_stacks
from kvtier.vllm.pinning import HostPinner, PinMode
from kvtier.vllm.transfer import ChunkCopy

STAGING_CAP = 32 << 20

_FillFn = Callable[[Fill, torch.Tensor, list[int], list[torch.Tensor]], None]


class CudaCopier:
    """Asynchronous copies between device KV pages and arena payloads (see module doc).

    ``pages``: the views of :func:`~kvtier.vllm.pages.page_views`. With a
    :class:`~kvtier.vllm.lanes.HostLane` and CPU tensors it runs the same code synchronously
    (tests). ``pinner``: how to pin the arena (None: leave it as it is).
    """

    synchronous = False

    def __init__(self, pages: Sequence[torch.Tensor], layout: PayloadLayout, rank: int,
                 lane: Lane, pinner: HostPinner | None = None,
                 staging_cap: int = STAGING_CAP) -> None:
        self.layout = layout
        self.rank = rank
        self.lane = lane
        self.pinner = pinner
        self.stacks: list[LayerStack] = layer_stacks(pages)
        self._spans = [StackSpan(s.first, s.layers) for s in self.stacks]
        with lane.use():  # the buffer belongs to the copy stream
            self.staging = torch.empty(staging_bytes(layout, staging_cap), dtype=torch.uint8,
                                       device=lane.device)
        self._registered: int | None = None
        self._keep: list[tuple[CopyEvent, torch.Tensor]] = []

    # ------------------------------------------------------------------ arena

    def attach(self, arena: np.ndarray) -> PinMode | None:
        """Pin a new arena mapping (once per mapping: a failure is not retried)."""
        self.detach()  # the caller attaches only a new mapping: never trust an old span
        if self.pinner is None:
            return None
        ptr = int(arena.ctypes.data)
        if self.pinner.register(ptr, int(arena.nbytes)):
            self._registered = ptr
            return PinMode.PINNED
        return PinMode.PAGEABLE

    def detach(self) -> None:
        if self._registered is None:
            return
        self.synchronize()  # no copy may still use the mapping
        assert self.pinner is not None
        self.pinner.unregister(self._registered)
        self._registered = None

    # ------------------------------------------------------------------ copies

    def store(self, chunks: Sequence[ChunkCopy]) -> CopyEvent:
        """KV pages -> payloads, after the work already queued (the step's forward)."""
        return self._run(chunks, self._store_fill)

    def load(self, chunks: Sequence[ChunkCopy]) -> CopyEvent:
        """Payloads -> KV pages, after the work already queued."""
        return self._run(chunks, self._load_fill)

    def _run(self, chunks: Sequence[ChunkCopy], do_fill: _FillFn) -> CopyEvent:
        fills = plan_fills([c.positions for c in chunks], self._spans, self.layout,
                           self.rank, int(self.staging.numel()))
        with self.lane.begin():
            start = self.lane.start()
            index = self.lane.index([b for c in chunks for b in c.block_ids])
            offsets = np.cumsum([0] + [len(c.block_ids) for c in chunks]).tolist()
            hosts = [torch.from_numpy(c.payload) for c in chunks]
            for fill in fills:
                do_fill(fill, index, offsets, hosts)
            event = self.lane.finish(start)
        self._keep = [(e, t) for e, t in self._keep if not _done(e)]
        self._keep.append((event, index))
        return event

    def _store_fill(self, fill: Fill, index: torch.Tensor, offsets: list[int],
                    hosts: list[torch.Tensor]) -> None:
        for piece in fill.pieces:
            stack, staged = self._staged(piece)
            ids = index[offsets[piece.chunk] : offsets[piece.chunk + 1]]
            torch.index_select(stack.view[piece.start : piece.stop], 1, ids, out=staged)
        for seg in fill.segments:
            host = hosts[seg.chunk][seg.payload : seg.payload + seg.length]
            host.copy_(self.staging[seg.staging : seg.staging + seg.length], non_blocking=True)

    def _load_fill(self, fill: Fill, index: torch.Tensor, offsets: list[int],
                   hosts: list[torch.Tensor]) -> None:
        for seg in fill.segments:
            host = hosts[seg.chunk][seg.payload : seg.payload + seg.length]
            self.staging[seg.staging : seg.staging + seg.length].copy_(host, non_blocking=True)
        for piece in fill.pieces:
            stack, staged = self._staged(piece)
            ids = index[offsets[piece.chunk] : offsets[piece.chunk + 1]]
            stack.view[piece.start : piece.stop].index_copy_(1, ids, staged)

    def _staged(self, piece: Piece) -> tuple[LayerStack, torch.Tensor]:
        """The piece's stack, and its region of the staging buffer shaped like a gather of
        the stack: ``[layers, pages, runs, run_words]``."""
        stack = self.stacks[piece.stack]
        _, _, runs, words = stack.view.shape
        size = (piece.stop - piece.start) * piece.pages * self.layout.page_bytes
        region = self.staging[piece.staging : piece.staging + size].view(stack.view.dtype)
        return stack, region.view(piece.stop - piece.start, piece.pages, runs, words)

    def synchronize(self) -> None:
        self.lane.synchronize()
        self._keep.clear()


def _done(event: CopyEvent) -> bool:
    try:
        return event.query()
    except Exception:  # the worker reports the failure; here it only means "let go"
        return True
