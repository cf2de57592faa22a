"""Small KV caches in a given layout, and chunks of a real arena, for the copier tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvtier.bench.kvcaches import KvShape, fill_random, kv_caches, shape_for
from kvtier.codec import HEADER_SIZE
from kvtier.tiers.arena import Arena
from kvtier.vllm.metadata import PayloadLayout
from kvtier.vllm.pages import page_views
from kvtier.vllm.transfer import ChunkCopy

SHAPE = KvShape(layers=4, num_blocks=40, block_size=16, heads=2, head_dim=16)
BLOCKS = 4  # per chunk
SRC = [[3, 9, 4, 20], [30, 31, 1, 2], [11, 12, 13, 14]]
DST = [[21, 22, 23, 24], [5, 6, 7, 8], [15, 16, 17, 18]]


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(f"kvtier-test-copier-{os.getpid()}", 8, 1 << 20)
    yield a
    a.close()
    a.unlink()


def setup(layout: str, tp: int = 1) -> tuple[list[torch.Tensor], PayloadLayout]:
    """Page views of a randomly filled cache in ``layout``, and its payload layout."""
    shape = shape_for(layout, SHAPE)
    caches = kv_caches(layout, shape)
    fill_random(caches, seed=3)
    return (page_views(caches, shape.num_blocks, shape.page_bytes),
            PayloadLayout(shape.layers, tp, BLOCKS, shape.page_bytes))


def payload(arena: Arena, slot: int, layout: PayloadLayout) -> np.ndarray:
    return arena.array[slot, HEADER_SIZE : HEADER_SIZE + layout.payload_len]


def chunks(arena: Arena, layout: PayloadLayout, first_slot: int, ids: list[list[int]]
           ) -> list[ChunkCopy]:
    return [ChunkCopy(payload(arena, first_slot + i, layout), b, range(BLOCKS))
            for i, b in enumerate(ids)]


def flat(ids: list[list[int]]) -> list[int]:
    return [b for chunk in ids for b in chunk]
