"""Page views and layer stacks for every KV cache layout vLLM can hand the connector.

The caches are CPU tensors shaped and strided as on CUDA: built by kvtier.bench.kvcaches,
which is checked here against vLLM's own ``create_kv_cache_views``.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.bench.kvcaches import LAYOUTS, PERMUTATIONS, KvShape, kv_caches, shape_for
from kvtier.errors import ConfigError
from kvtier.vllm.pages import layer_stacks, page_views

SHAPE = KvShape(layers=3, num_blocks=5, block_size=16, heads=2, head_dim=8)
RUNS = {"LHBNC": 2, "BHLNC": 2, "KV_OUTER": 2}  # heads (2) or K/V; every other layout: 1


def vllm_views(layout: str, shape: KvShape, kernel_block: int | None = None
               ) -> list[torch.Tensor]:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        MLAAttentionSpec,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    kind = KVCacheLayout[layout]
    if shape.mla:
        spec = MLAAttentionSpec(block_size=shape.block_size, num_kv_heads=1,
                                head_size=shape.head_dim, dtype=shape.dtype)
    else:
        spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.heads,
                                 head_size=shape.head_dim, dtype=shape.dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, shape.num_blocks, shape.layers, kind)
    raw = torch.zeros(shape.layers * shape.num_blocks * spec.page_size_bytes, dtype=torch.int8)
    tensor = KVCacheTensor(size=raw.numel(), layers=[str(i) for i in range(shape.layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    return create_kv_cache_views(raw, spec, shape.num_blocks, kind, tensor, kernel_block)


def geometry(views: list[torch.Tensor]) -> list[tuple[object, ...]]:
    return [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) for v in views]


@pytest.mark.parametrize("layout", list(PERMUTATIONS))
def test_emulated_layouts_are_vllms(layout: str) -> None:
    ours = list(kv_caches(layout, SHAPE).values())
    assert geometry(ours) == geometry(vllm_views(layout, SHAPE))
    if layout.startswith("LB"):  # kernel-block split: 2 kernel blocks per block
        split = KvShape(3, 5, 16, 2, 8, kernel_ratio=2)
        assert geometry(list(kv_caches(layout, split).values())) == geometry(
            vllm_views(layout, SHAPE, kernel_block=8))


def test_emulated_mla_is_vllms() -> None:
    mla = shape_for("MLA", KvShape(3, 5, 16, 1, 72))
    assert geometry(list(kv_caches("MLA", mla).values())) == geometry(
        vllm_views("LBNHC", mla))


def page_bytes_by_address(tensor: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """Block ``block``'s bytes of a layer cache in address order, worked out from scratch."""
    raw = tensor.view(torch.uint8) if tensor.dtype != torch.uint8 else tensor
    if raw.shape[0] % num_blocks == 0:
        ratio = raw.shape[0] // num_blocks
        sub = raw[block * ratio : (block + 1) * ratio]
    else:  # [2, num_blocks, ...]
        sub = raw[:, block]
    flat = torch.empty(0, dtype=torch.uint8).set_(raw.untyped_storage())
    grids = torch.meshgrid(*(torch.arange(n) for n in sub.shape), indexing="ij")
    addresses = sub.storage_offset() + sum(
        g * s for g, s in zip(grids, sub.stride(), strict=True))
    return flat[addresses.flatten().sort().values]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_page_is_its_runs_in_address_order(layout: str) -> None:
    shape = shape_for(layout, SHAPE)
    caches = kv_caches(layout, shape)
    for t in caches.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8))
    views = page_views(caches, shape.num_blocks, shape.page_bytes)
    assert len(views) == shape.layers
    assert {tuple(v.shape) for v in views} == {
        (shape.num_blocks, RUNS.get(layout, 1), shape.page_bytes // RUNS.get(layout, 1))}
    for view, t in zip(views, caches.values(), strict=True):
        for block in (0, 3):
            assert torch.equal(view[block].flatten(),
                               page_bytes_by_address(t, block, shape.num_blocks))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_allocations_are_one_stack_of_wide_words(layout: str) -> None:
    shape = shape_for(layout, SHAPE)
    views = page_views(kv_caches(layout, shape), shape.num_blocks, shape.page_bytes)
    (stack,) = layer_stacks(views)
    assert stack.first == 0 and stack.layers == shape.layers
    assert stack.view.dtype == torch.int64
    for layer, view in enumerate(views):
        assert torch.equal(stack.view[layer].view(torch.uint8), view)


def test_kernel_block_split_is_grouped_back_into_blocks() -> None:
    split = KvShape(3, 5, 16, 2, 8, kernel_ratio=2)
    caches = kv_caches("LBNHC", split)
    t = caches["model.layers.1.self_attn.attn"]
    assert t.shape[0] == 10
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                            dtype=torch.uint8))
    views = page_views(caches, 5, split.page_bytes)
    assert views[1].shape == (5, 1, split.page_bytes)
    whole = page_bytes_by_address(t[4:6], 0, 1)  # kernel blocks 4 and 5
    assert torch.equal(views[1][2].flatten(), whole)


def test_shared_layers_appear_once_and_layers_sort_by_index() -> None:
    backing = torch.arange(3 * 4 * 2 * 8, dtype=torch.float32).view(3, 4, 2, 8)
    caches = {"model.layers.10.attn": backing[2], "model.layers.2.attn": backing[1],
              "model.layers.0.attn": backing[0], "model.layers.1.attn": backing[0]}
    views = page_views(caches, num_blocks=4, page_bytes=2 * 8 * 4)
    assert [v.shape for v in views] == [(4, 1, 64)] * 3
    assert torch.equal(views[1][3, 0], backing[1, 3].contiguous().view(torch.uint8).flatten())
    assert torch.equal(views[2][0, 0], backing[2, 0].contiguous().view(torch.uint8).flatten())
    (stack,) = layer_stacks(views)  # evenly spaced in one allocation
    assert stack.layers == 3


def test_unevenly_placed_layers_make_several_stacks() -> None:
    backing = torch.zeros(5, 4, 64, dtype=torch.uint8)
    views = page_views({f"model.layers.{i}.attn": backing[s] for i, s in enumerate((0, 1, 3))},
                       num_blocks=4, page_bytes=64)
    stacks = layer_stacks(views)
    assert [(s.first, s.layers) for s in stacks] == [(0, 2), (2, 1)]


def test_odd_alignment_falls_back_to_narrower_words() -> None:
    backing = torch.zeros(3, 4, 12, dtype=torch.uint8)
    views = page_views({f"model.layers.{i}.attn": backing[i] for i in range(3)}, 4, 12)
    assert layer_stacks(views)[0].view.dtype == torch.int32


def test_a_padded_page_is_refused_with_its_shape_and_strides() -> None:
    t = torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"shape \(4, 2, 16, 16\), strides \(512, 256, 16, 1\)"
                       r".*1024 bytes, the KV spec says 2048"):
        page_views({"model.layers.0.attn": t}, num_blocks=4, page_bytes=2048)


def test_a_page_in_uneven_pieces_is_refused() -> None:
    t = torch.zeros(2, 8, 4, 32)[:, :, :3, :16]  # rows of 16 of 32, 3 of 4 rows per head
    with pytest.raises(ConfigError, match=r"evenly strided series.*VLLM_KV_CACHE_LAYOUT"):
        page_views({"model.layers.0.attn": t}, num_blocks=2, page_bytes=8 * 3 * 16 * 4)


def test_a_cache_without_a_block_dimension_is_refused() -> None:
    with pytest.raises(ConfigError, match="no dimension holds the 7 blocks"):
        page_views({"model.layers.0.attn": torch.zeros(4, 3, 8)}, num_blocks=7, page_bytes=96)
