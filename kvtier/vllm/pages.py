"""Where a block's page lies in a layer's KV cache tensor, for every layout vLLM uses.

vLLM 0.32 hands the worker one tensor per attention layer: a logical ``[B, H, N, C]`` view
(blocks, KV heads, tokens per block, K and V content side by side; MLA has H = 1) into one
int8 allocation, strided by the resolved ``KVCacheLayout``, a permutation of the logical
``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``, ``create_kv_cache_views``)::

    layout            chosen by                       one block's page in one layer
    LBNHC             CUDA default (FlashAttention)   1 run of H*N*C bytes
    LBHNC             CPU, FlashInfer on SM100        1 run
    BLNHC, BLHNC      VLLM_KV_CACHE_LAYOUT            1 run; blocks L pages apart
    LHBNC             VLLM_KV_CACHE_LAYOUT            H runs of N*C bytes, B*N*C apart
    BHLNC             VLLM_KV_CACHE_LAYOUT            H runs of N*C bytes, L*N*C apart

Older vLLM (and some out-of-tree backends) give each layer ``[2, num_blocks, ...]`` with K and
V outermost: a page is 2 runs, ``num_blocks`` pages apart. MLA backends may give ``[num_blocks,
block_size, dim]``. Kernel-block splitting (``num_blocks * ratio`` rows of smaller blocks) is
grouped back into scheduler blocks.

All of these are one shape here: ``uint8 [num_blocks, runs, run_bytes]`` with strides
(:func:`page_views`); a block's page in a chunk payload is its runs in address order, so the
bytes of a chunk are the same whether they were copied by the CPU or the CUDA path. Any other
layout (a page that is not one evenly strided series of equal gap-free runs, a page whose size
differs from the KV spec's, padded pages) is refused with its shape and strides.

Layers whose views are equally shaped and equally spaced in one allocation (vLLM puts every
layer of a KV cache group in one) form a :class:`LayerStack`, one strided tensor over all of
them, so one gather or scatter kernel serves every layer of a chunk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
SUPPORTED = ("LBNHC, LBHNC, BLNHC, BLHNC, LHBNC, BHLNC (vLLM 0.32), [2, num_blocks, ...] per "
             "layer, [num_blocks, block_size, dim] (MLA)")


def page_views(kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
               page_bytes: int) -> list[torch.Tensor]:
    """One ``uint8 [num_blocks, runs, run_bytes]`` view per distinct layer cache, in layer
    order. Layers that share a cache (same memory) appear once. Raises ConfigError for a
    layout this connector does not handle."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    views: list[tuple[tuple[int, str], torch.Tensor]] = []
    for name, tensor in kv_caches.items():
        ident = (tensor.data_ptr(), tuple(tensor.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        views.append((_layer_order(name), page_view(name, tensor, num_blocks, page_bytes)))
    views.sort(key=lambda item: item[0])
    return [view for _, view in views]


def _layer_order(name: str) -> tuple[int, str]:
    match = _LAYER_INDEX.search(name)
    return (int(match.group(1)) if match else -1, name)


def page_view(name: str, tensor: torch.Tensor, num_blocks: int, page_bytes: int
              ) -> torch.Tensor:
    """The ``uint8 [num_blocks, runs, run_bytes]`` view of one layer's cache."""
    elem = tensor.element_size()

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"KV cache of layer {name!r}: shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())} (in {elem}-byte elements): {why}. kvtier copies "
            f"these layouts: {SUPPORTED}; set VLLM_KV_CACHE_LAYOUT=LBNHC to use one")

    block_dim = _block_dim(tensor, num_blocks)
    if block_dim is None:
        raise refuse(f"no dimension holds the {num_blocks} blocks (or a multiple of them)")
    dims = list(zip(tensor.shape, tensor.stride(), strict=True))
    rows, row_stride = dims.pop(block_dim)
    ratio = rows // num_blocks  # kernel blocks per scheduler block
    if ratio > 1:
        dims.append((ratio, row_stride))
    runs = _runs(dims)
    if runs is None:
        raise refuse("a block's page is not one evenly strided series of equal gap-free runs")
    run, count, spacing = runs
    if count * run * elem != page_bytes:
        raise refuse(f"a block's page is {count * run * elem} bytes, the KV spec says "
                     f"{page_bytes} (padded pages are not supported)")
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(tensor.untyped_storage(), tensor.storage_offset() * elem,
              (num_blocks, count, run * elem),
              (row_stride * ratio * elem, spacing * elem, 1))
    return view


def _block_dim(tensor: torch.Tensor, num_blocks: int) -> int | None:
    if tensor.dim() >= 1 and tensor.shape[0] % num_blocks == 0:
        return 0
    if tensor.dim() >= 3 and tensor.shape[0] == 2 and tensor.shape[1] % num_blocks == 0:
        return 1  # K and V outermost: [2, num_blocks, ...]
    return None


def _runs(dims: Sequence[tuple[int, int]]) -> tuple[int, int, int] | None:
    """``(run, count, spacing)`` in elements if the (size, stride) dims of a page are
    ``count`` gap-free runs of ``run`` elements, ``spacing`` apart; else None."""
    ordered = sorted((stride, size) for size, stride in dims if size > 1)
    if any(stride <= 0 for stride, _ in ordered):
        return None
    run, i = 1, 0
    while i < len(ordered) and ordered[i][0] == run:
        run *= ordered[i][1]
        i += 1
    rest = ordered[i:]
    if not rest:
        return run, 1, run
    spacing, count = rest[0]
    if spacing < run:
        return None
    for stride, size in rest[1:]:
        if stride != spacing * count:
            return None
        count *= size
    return run, count, spacing


@dataclass(frozen=True)
class LayerStack:
    """Consecutive layers (from ``first``) as one strided tensor ``[layers, num_blocks, runs,
    run_words]`` of an integer dtype as wide as the alignment allows (fewer, wider elements
    make faster gather and scatter kernels)."""

    first: int
    view: torch.Tensor

    @property
    def layers(self) -> int:
        return int(self.view.shape[0])


def layer_stacks(views: Sequence[torch.Tensor]) -> list[LayerStack]:
    """Group page views (from :func:`page_views`, in layer order) into stacks."""
    stacks: list[LayerStack] = []
    i = 0
    while i < len(views):
        j, spacing = i + 1, 0
        while j < len(views) and _alike(views[i], views[j]):
            gap = int(views[j].storage_offset() - views[j - 1].storage_offset())
            if gap <= 0 or (spacing and gap != spacing):
                break
            spacing, j = gap, j + 1
        stacks.append(LayerStack(i, _stack(views[i:j], spacing)))
        i = j
    return stacks


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def _stack(views: Sequence[torch.Tensor], spacing: int) -> torch.Tensor:
    first = views[0]
    num_blocks, count, run = first.shape
    row, gap, _ = first.stride()
    spacing = spacing or row * num_blocks  # one layer: any stride is valid
    stacked = torch.empty(0, dtype=torch.uint8, device=first.device)
    stacked.set_(first.untyped_storage(), first.storage_offset(),
                 (len(views), num_blocks, count, run), (spacing, row, gap, 1))
    offset = first.storage_offset()
    base = first.untyped_storage().data_ptr()
    for dtype in (torch.int64, torch.int32, torch.int16):
        width = dtype.itemsize
        if all(v % width == 0 for v in (run, row, gap, spacing, offset, base)):
            return stacked.view(dtype)
    return stacked
