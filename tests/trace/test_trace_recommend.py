"""The recommendation: smallest sizes for a share of the achievable hit ratio, best admission."""

from __future__ import annotations

import pytest
from trace_helpers import BT, req, trace_a

from kvtier.trace.formats import Trace
from kvtier.trace.recommend import (
    AdmissionOption,
    _smallest,
    host_size,
    pick_admission,
    recommend,
)
from kvtier.trace.simulate import HOST, TierSpec


def cyclic() -> Trace:
    """[1] [2] [3] [1] [2] [3]: the second round can hit only if all three are kept."""
    return Trace([req([b]) for b in (1, 2, 3, 1, 2, 3)], BT, "mooncake", "cyclic")


@pytest.mark.parametrize(("share", "chunks", "hits"), [(0.5, 2, 4), (0.8, 4, 5), (0.9, 5, 6)])
def test_lru_host_size_replays_the_simulator(share: float, chunks: int, hits: int) -> None:
    """Trace A reaches 6 of 12 blocks unbounded. LRU hosts of 1..5 chunks hit 2, 4, 4, 5, 6
    (1 to 3 worked in test_trace_simulate and test_trace_cli; 4 and 5 replayed).
    50% of 6 = 3 hits -> 2 chunks (4 hits); 80% -> 4.8 -> 5 hits -> 4 chunks; 90% -> 5.4
    -> 6 hits -> 5 chunks. The search from [1, 6 unique blocks] probes 2 (then 3, 4, 5),
    and each answer is within 2% of the one below it, so these are the smallest."""
    trace = Trace(trace_a(), BT, "mooncake", "a")
    size = host_size(trace, TierSpec(HOST, 1), share * 0.5)
    assert size is not None
    assert (size.chunks, size.block_hit_ratio) == (chunks, pytest.approx(hits / 12))


def test_bisection_finds_the_smallest_size() -> None:
    """ratio(c) = c / 100, goal 0.37: the answer is 37 (the search stops within 2%, and
    37 * 1.02 < 38, so it is exact here)."""
    size = _smallest("disk", lambda c: c / 100, 0.37, 1000)
    assert size is not None
    assert size.chunks == 37


def test_recommend_on_a_cycle() -> None:
    """Host 1 chunk, disk 3 chunks write-through; target 100% of the achievable 3/6.

    Host alone (LRU), replayed: 2 chunks evict each block before it comes back (0 hits),
    3 keep all -> 3 chunks.
    Disk under that 1-chunk host: 2 chunks evict 1 before it returns (no hit); 3 keep all
    -> 3 chunks, reaching 0.5.
    Admission: always -> 3 hits, 3 writes. after_uses=2 -> first round refused, second
    round misses and writes all 3 -> 0 hits. after_uses=3 / min_prefix_tokens=2048 (block 0
    completes only 512 tokens) -> 0 hits, 0 writes. Allowing 1 point of loss keeps
    'always'; allowing everything picks the first of the 0-write rules, after_uses=3.
    """
    specs = [TierSpec(HOST, 1), TierSpec("disk", 3)]
    rec = recommend(cyclic(), specs, target_share=1.0, max_hit_loss=0.01)
    assert rec.achievable_block_hit_ratio == pytest.approx(0.5)
    assert rec.host is not None and rec.host.chunks == 3
    assert rec.lower is not None and (rec.lower.chunks, rec.lower.block_hit_ratio) == (3, 0.5)
    options = {o.rules: (round(o.block_hit_ratio * 6), o.lower_blocks_written)
               for o in rec.admission_options}
    assert options[()] == (3, 3)
    assert options[(("after_uses", 2),)] == (0, 3)
    assert options[(("after_uses", 3),)] == (0, 0)
    assert options[(("min_prefix_tokens", 2048),)] == (0, 0)
    assert rec.admission is not None and rec.admission.rules == ()
    assert pick_admission(rec.admission_options, 1.0).rules == (("after_uses", 3),)  # type: ignore[union-attr]


def test_pick_admission_trades_writes_for_allowed_loss() -> None:
    """Base 50.0% with 100 writes; after_uses=2 loses 0.5 points for 40 writes; after_uses=3
    loses 3 points for 20. Allowed 1 point -> after_uses=2; allowed 5 -> after_uses=3."""
    options = [
        AdmissionOption((), 0.500, 100),
        AdmissionOption((("after_uses", 2),), 0.495, 40),
        AdmissionOption((("after_uses", 3),), 0.470, 20),
    ]
    assert pick_admission(options, 0.01) == options[1]
    assert pick_admission(options, 0.05) == options[2]
    assert pick_admission([], 0.01) is None
