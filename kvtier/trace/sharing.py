"""Which prefixes are shared, by how many requests: the hottest maximal shared prefixes.

A block id names a whole prefix. Listing the most shared blocks would repeat a popular system
prompt once per block, so a prefix is reported only where sharing drops: at a block none of
whose children is shared by as many requests (a *maximal* shared prefix)::

    requests sharing:  b0:900 -> b1:900 -> b2:900 -> b3:40 ...
    reported:                            b2 (3 blocks, 900 requests)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.trace.formats import show_block
from kvtier.trace.reuse import Accesses
from kvtier.trace.stats import Bucket, power_of_two_buckets


@dataclass(frozen=True)
class HotPrefix:
    block: str
    """The id of the prefix's last block, as the trace writes it."""
    blocks: int
    prefix_tokens: int
    requests: int
    reused_tokens: int
    """Tokens that repeat this prefix after its first request: (requests - 1) * prefix_tokens."""


@dataclass(frozen=True)
class Sharing:
    unique_blocks: int
    shared_blocks: int
    """Blocks in two or more requests."""
    requests_per_block: list[Bucket]
    hottest: list[HotPrefix]


def requests_per_block(acc: Accesses) -> np.ndarray:
    """How many distinct requests contain each block (indexed by dense block number)."""
    n_blocks = len(acc.keys)
    pairs = np.unique(acc.request * n_blocks + acc.ids)
    return np.bincount(pairs % n_blocks, minlength=n_blocks)


def sharing(acc: Accesses, block_tokens: int, top: int = 10) -> Sharing:
    counts = requests_per_block(acc)
    return Sharing(
        unique_blocks=len(counts),
        shared_blocks=int(np.count_nonzero(counts >= 2)),
        requests_per_block=power_of_two_buckets(counts),
        hottest=_hottest(acc, counts, block_tokens, top),
    )


def _hottest(acc: Accesses, counts: np.ndarray, block_tokens: int, top: int) -> list[HotPrefix]:
    first = np.unique(acc.ids, return_index=True)[1]
    depth = acc.position[first]
    child_max = np.zeros(len(counts), dtype=np.int64)
    has_parent = acc.position[first] > 0
    parents = acc.ids[first[has_parent] - 1]
    np.maximum.at(child_max, parents, counts[has_parent])
    maximal = (counts >= 2) & (child_max < counts)
    candidates = np.flatnonzero(maximal)
    reused = (counts[candidates] - 1) * (depth[candidates] + 1) * block_tokens
    order = np.lexsort((-counts[candidates], -reused))[:top]
    return [
        _hot(acc, int(b), int(depth[b]) + 1, int(counts[b]), block_tokens)
        for b in candidates[order]
    ]


def _hot(acc: Accesses, block: int, blocks: int, requests: int, block_tokens: int) -> HotPrefix:
    tokens = blocks * block_tokens
    return HotPrefix(
        show_block(acc.keys[block]), blocks, tokens, requests, (requests - 1) * tokens
    )
