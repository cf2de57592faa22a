"""KV cache tensors laid out as vLLM lays them out, built with plain torch (no vLLM needed).

For ``kvtier bench gpu`` and the tests. vLLM 0.32 allocates one flat byte buffer per KV cache
group and views it per layer as a logical ``[B, H, N, C]`` tensor (C: K and V side by side)
strided by a ``KVCacheLayout``, a permutation of the logical ``[L, B, H, N, C]``
(``create_kv_cache_views``); these are rebuilt here the same way (the tests compare them with
vLLM's own function). Also: the K/V-outer ``[2, num_blocks, block_size, heads, head_dim]``
per layer of older vLLM, MLA as vLLM 0.32 lays it out (one head, no K/V split) and MLA's
``[num_blocks, block_size, dim]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

PERMUTATIONS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYOUTS = (*PERMUTATIONS, "KV_OUTER", "MLA", "MLA_3D")
"""What each name stands for: a vLLM 0.32 ``KVCacheLayout``; ``KV_OUTER``: FlashAttention
before vLLM 0.12; ``MLA``: an MLA cache in vLLM 0.32 (LBNHC, one head); ``MLA_3D``: the
``[num_blocks, block_size, dim]`` shape of an MLA backend."""


@dataclass(frozen=True)
class KvShape:
    layers: int
    num_blocks: int
    block_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    kernel_ratio: int = 1
    """Kernel blocks per scheduler block (vLLM's kernel-block split, LB* layouts only)."""
    mla: bool = False
    """One latent vector per token (MLA): one head, content ``head_dim``, no K/V pair."""

    @property
    def content(self) -> int:
        """Elements per token and head."""
        return self.head_dim if self.mla else 2 * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.heads * self.block_size * self.content * self.dtype.itemsize


def shape_for(layout: str, shape: KvShape) -> KvShape:
    """``shape`` adjusted to what the layout implies (MLA: one head)."""
    if layout.startswith("MLA"):
        return replace(shape, heads=1, mla=True)
    return shape


def kv_caches(layout: str, shape: KvShape, device: torch.device | str = "cpu"
              ) -> dict[str, torch.Tensor]:
    """Per layer name (``model.layers.{i}.self_attn.attn``), its view of one allocation."""
    shape = shape_for(layout, shape)
    if layout in PERMUTATIONS or layout == "MLA":
        views = _permuted(PERMUTATIONS.get(layout, PERMUTATIONS["LBNHC"]), shape, device)
    elif layout == "KV_OUTER":
        raw = _raw((shape.layers, 2, shape.num_blocks, shape.block_size, shape.heads,
                    shape.head_dim), shape.dtype, device)
        views = list(raw)
    elif layout == "MLA_3D":
        raw = _raw((shape.layers, shape.num_blocks, shape.block_size, shape.head_dim),
                   shape.dtype, device)
        views = list(raw)
    else:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}


def _raw(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
         ) -> torch.Tensor:
    return torch.zeros(math.prod(dims), dtype=dtype, device=device).view(dims)


def _permuted(order: tuple[int, ...], shape: KvShape, device: torch.device | str
              ) -> list[torch.Tensor]:
    ratio = shape.kernel_ratio
    if shape.block_size % ratio:
        raise ValueError(f"kernel ratio {ratio} does not divide block size {shape.block_size}")
    logical = (shape.layers, shape.num_blocks * ratio, shape.heads, shape.block_size // ratio,
               shape.content * shape.dtype.itemsize)
    physical = _raw(tuple(logical[d] for d in order), torch.uint8, device)
    view5 = physical.permute(*(order.index(d) for d in range(5)))
    return [view5[layer].view(shape.dtype) for layer in range(shape.layers)]


def fill_random(caches: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Random bytes in every layer's cache (the same for the same seed and device)."""
    gen = torch.Generator(device=next(iter(caches.values())).device).manual_seed(seed)
    for t in caches.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, device=t.device,
                                                generator=gen))
