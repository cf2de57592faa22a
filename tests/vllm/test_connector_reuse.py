"""The connector's translation of vLLM's scheduler output into the step's block reuse."""

from __future__ import annotations

import dataclasses

from kvtier.vllm.fencing import Reuse


def test_every_block_a_step_hands_out_or_writes_counts_as_reused() -> None:
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from kvtier.vllm.connector import _step_view

    new = NewRequestData("new", [1, 2, 3], [], None, None, ([0, 4, 5],), 0, None)
    cached = dataclasses.replace(
        CachedRequestData.make_empty(), req_ids=["grown", "resumed", "decoding"],
        resumed_req_ids={"resumed"}, new_block_ids=[([6],), ([7, 8],), None],
        num_computed_tokens=[10, 0, 20], num_output_tokens=[1, 0, 2])
    out = dataclasses.replace(
        SchedulerOutput.make_empty(), scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
        new_block_ids_to_zero=[9], kv_cache_block_copies=[KVCacheBlockCopy(4, 10)])
    view = _step_view(out)
    assert view.reuse == Reuse(frozenset({4, 5, 6, 7, 8, 9, 10}), preempted=False)
    assert [s.req_id for s in view.scheduled] == ["new", "grown", "resumed", "decoding"]
    preempting = dataclasses.replace(out, preempted_req_ids={"old"})
    assert _step_view(preempting).reuse.preempted
    assert _step_view(SchedulerOutput.make_empty()).reuse == Reuse()
