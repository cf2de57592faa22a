"""Reuse of blocks over the flattened access stream: previous/next use and stack distances.

A trace is flattened into one access per block of every request, in replay order. For the
access at position ``t`` to a block last used at ``p``::

    reuse time       ts[t] - ts[p]
    stack distance   1 + distinct other blocks used in (p, t)   (its depth in an LRU stack)

Stack distances describe the trace (how much else is used between two uses of a block); they
do not give the store's LRU hit ratio at each size. The store touches a served prefix tail
first when it is leased and inserts the recomputed blocks tail first when they are
committed, so where a block ends up in recency order depends on whether it was a hit, which
depends on the size. Its LRU is therefore not a stack algorithm: a host of C chunks may hold
a block that a host of C + 1 has evicted (``test_trace_reuse`` works an example by hand), so
no single recency stack, and no one-pass curve over it, can be exact. Finite sizes are
replayed through :mod:`kvtier.trace.simulate`; an unbounded cache evicts nothing and is exact
here (:func:`infinite_hits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.trace.formats import BlockId, Request

COLD = np.iinfo(np.int64).max
"""The stack distance of a first use: no cache size makes it a hit."""


@dataclass(frozen=True)
class Accesses:
    """The flattened stream: one entry per block of each request, in replay order."""

    ids: np.ndarray
    """Dense block numbers (0..n_blocks-1), in order of first use."""
    request: np.ndarray
    position: np.ndarray
    """Index of the block within its request."""
    ts: np.ndarray
    hit_tokens: np.ndarray
    """Tokens the access adds to hit tokens when it hits: block_tokens, or 0 if partial."""
    keys: list[BlockId]
    """The trace's own id of each dense block number."""

    def __len__(self) -> int:
        return len(self.ids)


def flatten(requests: list[Request]) -> Accesses:
    numbers: dict[BlockId, int] = {}
    ids: list[int] = []
    request_of: list[int] = []
    position: list[int] = []
    ts: list[float] = []
    hit_tokens: list[int] = []
    for r_index, r in enumerate(requests):
        n = len(r.blocks)
        ids.extend(numbers.setdefault(b, len(numbers)) for b in r.blocks)
        request_of.extend([r_index] * n)
        position.extend(range(n))
        ts.extend([r.ts_s] * n)
        full = r.full_blocks
        hit_tokens.extend([r.block_tokens] * full + [0] * (n - full))
    return Accesses(
        np.asarray(ids, dtype=np.int64),
        np.asarray(request_of, dtype=np.int64),
        np.asarray(position, dtype=np.int64),
        np.asarray(ts, dtype=np.float64),
        np.asarray(hit_tokens, dtype=np.int64),
        list(numbers),
    )


def previous_use(ids: np.ndarray) -> np.ndarray:
    """Position of the previous access to the same block, -1 for a first use."""
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    prev = np.full(len(ids), -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    return prev


def next_use(ids: np.ndarray) -> np.ndarray:
    """Position of the next access to the same block, ``len(ids)`` for a last use."""
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    nxt = np.full(len(ids), len(ids), dtype=np.int64)
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def stack_distances(ids: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (:data:`COLD` for first uses).

    Distinct blocks in (p, t) = (t - p - 1) minus the accesses j in (p, t) whose block comes
    back before t; those are exactly the j > p with next[j] < t, counted for all t at once.
    """
    n = len(ids)
    prev, nxt = previous_use(ids), next_use(ids)
    t = np.arange(n, dtype=np.int64)
    warm = prev >= 0
    qt, qp = t[warm], prev[warm]
    returned_before_t = np.searchsorted(np.sort(nxt), qt, side="left")
    returned_by_p = _count_below(nxt, qp + 1, qt)
    out = np.full(n, COLD, dtype=np.int64)
    out[warm] = 1 + (qt - qp - 1) - (returned_before_t - returned_by_p)
    return out


def _count_below(values: np.ndarray, ends: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """For each query q: how many x < ends[q] have values[x] < bounds[q].

    A merge-sort tree, one numpy pass per level: level k sorts the values within aligned
    blocks of 2**k positions, and the prefix [0, end) is the union of one block per set bit
    of ``end``, each counted with a binary search.
    """
    n = len(values)
    stride = int(max(values.max(initial=0), bounds.max(initial=0))) + 1
    positions = np.arange(n, dtype=np.int64)
    counts = np.zeros(len(ends), dtype=np.int64)
    for k in range(max(1, n.bit_length())):
        take = ((ends >> k) & 1).astype(bool)
        if not take.any():
            continue
        block = (ends[take] >> k) - 1
        level = np.sort((positions >> k) * stride + values)
        found = np.searchsorted(level, block * stride + bounds[take], side="left")
        counts[take] += found - (block << k)
    return counts


def infinite_hits(acc: Accesses) -> np.ndarray:
    """Which accesses an unbounded cache serves under the prefix rule: those whose block,
    and every block before it in the request, was used by an earlier request."""
    prev = previous_use(acc.ids)
    seen = prev >= 0
    seen[seen] = acc.request[prev[seen]] < acc.request[seen]
    misses = (~seen).astype(np.int64)
    so_far = np.cumsum(misses)
    first = np.searchsorted(acc.request, acc.request, side="left")  # requests are contiguous
    return np.asarray(so_far - (so_far[first] - misses[first]) == 0)
