"""What an eviction policy could reach on a Mooncake-style trace with more knowledge than
the trace gives it: the bounds behind issue 18's "blocked" (docs/trace.md, "What the
held-out trace allows").

    python bounds.py conversation_trace.jsonl [--blocks 1953,5859,19531] [--classifier]

One tier of ``--blocks`` 512-token blocks, the block prefix-hit ratio as `kvtier trace
simulate` counts it (a request's hit is its leading blocks present before it is stored; its
blocks are then stored tail first, so the head is the most recent). Lines:

- ``lru``: every request stored, least recently used out (kvtier's LRU line: the check).
- ``oracle-which``: the tier is told which requests their conversation continues (a later
  request extends this one's blocks) and stores only those, LRU among them: perfect
  knowledge of *which* conversations return, none of *when*.
- ``oracle-score k``: every request stored; a block's rank is its last use + k * capacity
  if its request continues: the same knowledge as a retention bonus (the shape of the
  ``prefix`` policy's and the learned hazard's score).
- ``classifier k`` (``--classifier``, needs scikit-learn): the bonus scaled by a gradient-
  boosted classifier's out-of-fold P(continues) from every feature the trace has at request
  time (turn, input and output lengths, new and shared blocks, the previous turn's gap in
  seconds and accesses and its output length, time, requests in the last minute). Fitted
  on the trace it is scored on (5 shuffled folds): an optimistic stand-in for any policy
  that learns from these features.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def conversations(reqs: Sequence[dict]) -> tuple[list[int | None], list[int]]:
    """Each request's parent (the latest earlier request whose blocks it extends by at
    least two leading blocks, the first being the shared system prompt) and how many of
    its leading blocks an earlier request had."""
    owner: dict[int, int] = {}
    parent: list[int | None] = []
    shared: list[int] = []
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        k, last = 0, None
        while k < len(h) and h[k] in owner:
            last = owner[h[k]]
            k += 1
        p = last if k >= 2 else None
        parent.append(p)
        shared.append(k)
        for b in h:
            owner[b] = i
    return parent, shared


def prefix_hit(blocks: Sequence[int], held: Container[int]) -> int:
    """How many of a request's leading blocks the tier holds (a lookup stops at a miss)."""
    k = 0
    while k < len(blocks) and blocks[k] in held:
        k += 1
    return k


def lru(reqs: Sequence[dict], capacity: int, store: Callable[[int], bool]) -> float:
    held: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        hits += prefix_hit(h, held)
        total += len(h)
        if store(i):
            for b in reversed(h):
                if b in held:
                    held.move_to_end(b)
                else:
                    held[b] = None
            while len(held) > capacity:
                held.popitem(last=False)
    return hits / total


def scored(reqs: Sequence[dict], capacity: int, bonus: Sequence[float]) -> float:
    """Rank = step of last use + bonus[request] * capacity; the lowest rank leaves."""
    rank: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = total = step = 0
    for i, r in enumerate(reqs):
        h = r["hash_ids"]
        hits += prefix_hit(h, rank)
        total += len(h)
        for b in reversed(h):
            step += 1
            v = step + bonus[i] * capacity
            rank[b] = v
            heapq.heappush(heap, (v, b))
        while len(rank) > capacity:
            v, b = heapq.heappop(heap)
            if rank.get(b) == v:
                del rank[b]
    return hits / total


def classifier_scores(reqs: Sequence[dict], parent: Sequence[int | None],
                      shared: Sequence[int], continues: Sequence[bool]) -> list[float]:
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import KFold, cross_val_predict

    pos, p = [], 0
    for r in reqs:
        pos.append(p)
        p += len(r["hash_ids"])
    ts = [r["timestamp"] for r in reqs]
    turn: list[int] = []
    rows = []
    for i, r in enumerate(reqs):
        pa = parent[i]
        turn.append(1 if pa is None else turn[pa] + 1)
        gap_s = gap_a = prev_out = -1.0
        if pa is not None:
            gap_s, gap_a = ts[i] - ts[pa], pos[i] - pos[pa]
            prev_out = reqs[pa]["output_length"]
        rows.append([turn[i], r["input_length"], r["output_length"],
                     len(r["hash_ids"]) - shared[i], shared[i], gap_s, gap_a, prev_out,
                     ts[i], i - bisect.bisect_left(ts, ts[i] - 60_000)])
    x, y = np.array(rows, float), np.array(continues)
    folds = KFold(5, shuffle=True, random_state=0)
    prob = cross_val_predict(HistGradientBoostingClassifier(max_iter=200), x, y, cv=folds,
                             method="predict_proba")[:, 1]
    print(f"classifier: out-of-fold AUC {roc_auc_score(y, prob):.3f} "
          f"(turn alone {roc_auc_score(y, x[:, 0]):.3f})")
    return [float(v) for v in prob]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--blocks", default="1953,5859,19531",
                    help="tier sizes in 512-token blocks (1, 3, 10 Mtok)")
    ap.add_argument("--classifier", action="store_true")
    args = ap.parse_args()
    reqs = load(args.trace)
    parent, shared = conversations(reqs)
    continues = [False] * len(reqs)
    for p in parent:
        if p is not None:
            continues[p] = True
    print(f"{len(reqs)} requests, {sum(continues)} continued "
          f"({sum(continues) / len(reqs):.1%})")
    probs = classifier_scores(reqs, parent, shared, continues) if args.classifier else None
    for c in (int(s) for s in args.blocks.split(",")):
        line = [f"{c} blocks", f"lru {lru(reqs, c, lambda i: True):.1%}",
                f"oracle-which {lru(reqs, c, lambda i: continues[i]):.1%}"]
        for k in (2, 4, 8):
            line.append(f"oracle-score {k} {scored(reqs, c, [k * v for v in continues]):.1%}")
        if probs is not None:
            for k in (4, 6, 10):
                line.append(f"classifier {k} {scored(reqs, c, [k * v for v in probs]):.1%}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
