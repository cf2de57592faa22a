"""The CUDA copier's own code on CPU tensors (a host lane), for every layout vLLM uses.

The KV caches are shaped and strided as each CUDA backend lays them out; the arena is a real
one. What the GPU adds (streams, events, DMA) is checked by ``kvtier bench gpu`` on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from copier_helpers import DST, SRC, arena, chunks, flat, payload, setup

from kvtier.bench.kvcaches import LAYOUTS
from kvtier.tiers.arena import Arena
from kvtier.vllm.cuda_copier import CudaCopier
from kvtier.vllm.fills import staging_bytes
from kvtier.vllm.lanes import HostLane
from kvtier.vllm.transfer import ChunkCopy, CpuCopier

__all__ = ["arena"]  # a fixture

@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_writes_the_cpu_copiers_bytes(arena: Arena, layout: str, tp: int,
                                                 rank: int) -> None:
    pages, lay = setup(layout, tp)
    cap = lay.payload_len // tp // 3  # several fills per call
    copier = CudaCopier(pages, lay, rank, HostLane(), staging_cap=cap)
    copier.store(chunks(arena, lay, 0, SRC)).synchronize()
    CpuCopier(pages, lay, rank).store(chunks(arena, lay, 3, SRC))
    for i in range(3):
        assert np.array_equal(payload(arena, i, lay), payload(arena, 3 + i, lay))
    assert payload(arena, 0, lay).any()
    copier.load(chunks(arena, lay, 0, DST)).synchronize()
    for p in pages:
        assert torch.equal(p[flat(DST)], p[flat(SRC)])


@pytest.mark.parametrize("layout", ["LBNHC", "LHBNC", "KV_OUTER"])
def test_a_partial_load_fills_only_its_blocks(arena: Arena, layout: str) -> None:
    pages, lay = setup(layout)
    copier = CudaCopier(pages, lay, 0, HostLane())
    copier.store(chunks(arena, lay, 0, SRC[:1])).synchronize()
    before = [p.clone() for p in pages]
    copier.load([ChunkCopy(payload(arena, 0, lay), [25, 26], [3, 1])]).synchronize()
    for p, old in zip(pages, before, strict=True):
        assert torch.equal(p[[25, 26]], p[[SRC[0][3], SRC[0][1]]])
        others = [b for b in range(p.shape[0]) if b not in (25, 26)]
        assert torch.equal(p[others], old[others])


def test_the_staging_buffer_is_allocated_once_and_bounded(arena: Arena) -> None:
    pages, lay = setup("LBNHC")
    copier = CudaCopier(pages, lay, 0, HostLane(), staging_cap=1 << 30)
    ptr = copier.staging.data_ptr()
    assert copier.staging.numel() == staging_bytes(lay, 1 << 30) == lay.payload_len
    for _ in range(3):
        copier.store(chunks(arena, lay, 0, SRC)).synchronize()
        copier.load(chunks(arena, lay, 0, DST)).synchronize()
    assert copier.staging.data_ptr() == ptr
