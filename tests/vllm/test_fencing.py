"""Waiting only for the stores whose blocks vLLM reuses (kvtier.vllm.fencing + the worker).

The scenario tests run the real scheduler and worker sides and a real server; the copies go
through the staged CUDA copier on CPU tensors, deferred by a fake stream (tests whose names
say "fake"), so a store nobody waited for really reads its blocks late.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_stream import FakeStream, FakeStreamCopier
from rig import FakeEngine

from kvtier.vllm.fencing import Reuse, StoreFences
from kvtier.vllm.lanes import HostLane
from kvtier.vllm.metadata import StoreJob

PROMPT_A = list(range(100, 200))  # 100 tokens: 3 full chunks, 7 blocks
PROMPT_B = list(range(500, 600))
PROMPT_C = list(range(900, 964))  # 2 chunks, 4 blocks


def job(key: bytes, *blocks: int) -> StoreJob:
    return StoreJob(key, 0, "arena", list(blocks))


def test_fences_flush_the_stores_of_reused_blocks_in_planning_order() -> None:
    fences = StoreFences()
    fences.add([job(b"a1", 1, 2), job(b"a2", 3, 4), job(b"c1", 7, 8)])
    fences.check_integrity()
    assert fences.flush(Reuse(frozenset({9, 10}))) == []
    assert fences.flush(Reuse(frozenset({4, 1, 9}))) == [b"a1", b"a2"]
    fences.check_integrity()
    assert len(fences) == 1
    assert fences.flush(Reuse(frozenset({1, 2, 3}))) == []  # already flushed: no second wait


def test_fences_of_settled_stores_are_dropped() -> None:
    fences = StoreFences()
    fences.add([job(b"a1", 1, 2), job(b"a2", 3, 4)])
    fences.retain({b"a2"})  # a1 committed or aborted
    fences.check_integrity()
    assert fences.flush(Reuse(frozenset({1, 2, 3}))) == [b"a2"]
    assert len(fences) == 0


def test_a_preemption_flushes_every_pending_store() -> None:
    fences = StoreFences()
    fences.add([job(b"a1", 1, 2), job(b"c1", 7, 8)])
    assert fences.flush(Reuse(preempted=True)) == [b"a1", b"c1"]
    fences.check_integrity()
    assert len(fences) == 0


# ---------------------------------------------------------------------- scenarios


@pytest.fixture
def fake_stream_engine(make_server: Any) -> Iterator[tuple[FakeEngine, FakeStream]]:
    server = make_server(slots=32)
    engine = FakeEngine(server.socket_path, lane=HostLane)
    stream = FakeStream()
    for worker in engine.workers:
        worker.copier = FakeStreamCopier(worker.copier, stream)  # type: ignore[assignment]
    yield engine, stream
    stream.drain()
    engine.close()


def reused_by_next_request(engine: FakeEngine, finished: str, tokens: list[int]) -> str:
    """Finish ``finished`` and admit a request that vLLM gives its freed blocks."""
    blocks = list(engine.reqs[finished].blocks)
    engine.finish(finished)
    engine.free = blocks + [b for b in engine.free if b not in blocks]
    req = engine.add(tokens)
    assert engine.reqs[req].blocks == blocks
    return req


def run_with_stream(engine: FakeEngine, stream: FakeStream, req_id: str) -> None:
    """Step until the request computed its prompt, the "GPU" catching up between steps."""
    engine.run(req_id, steps=20, between=stream.drain)


def test_fake_stream_flush_waits_only_for_stores_whose_blocks_are_reused(
        fake_stream_engine: tuple[FakeEngine, FakeStream]) -> None:
    engine, stream = fake_stream_engine
    a = engine.add(PROMPT_A)
    plan_a = engine.step()
    assert len(plan_a.stores) == 3 and not stream.events[0].done  # A's stores still pending
    c = engine.add(PROMPT_C)
    plan_c = engine.step()
    assert plan_c.flush == []  # C got fresh blocks: nothing to wait for
    event_a, event_c = stream.events
    b = reused_by_next_request(engine, a, PROMPT_B)
    plan_b = engine.step()
    assert plan_b.flush == [job.key for job in plan_a.stores]
    assert event_a.waited and event_a.done  # waited for before B's forward rewrote them
    assert not event_c.waited and not event_c.done  # C's store keeps running
    assert engine.workers[0].take_counters()["flushed_stores"] == 1
    assert engine.sched.has_pending_work()  # C's and B's stores are not confirmed yet
    stream.drain()
    engine.step()
    assert not engine.sched.has_pending_work()
    engine.finish(b)
    engine.finish(c)
    again = engine.add(PROMPT_A)
    assert engine.hit(again) == 96
    run_with_stream(engine, stream, again)
    assert engine.blocks_match_recompute(again, 6)  # A's chunks hold A's KV


def test_fake_stream_without_the_flush_a_store_copies_the_next_requests_kv(
        fake_stream_engine: tuple[FakeEngine, FakeStream]) -> None:
    engine, stream = fake_stream_engine
    engine.sched.fences.flush = lambda reuse: []  # type: ignore[method-assign]
    a = engine.add(PROMPT_A)
    engine.step()
    b = reused_by_next_request(engine, a, PROMPT_B)
    engine.step()  # B's forward rewrites A's blocks before A's store has read them
    stream.drain()
    engine.step()
    engine.finish(b)
    again = engine.add(PROMPT_A)
    assert engine.hit(again) == 96
    run_with_stream(engine, stream, again)
    assert not engine.blocks_match_recompute(again, 6)  # what the flush prevents
