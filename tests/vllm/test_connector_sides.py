"""The connector's scheduler and worker sides against a real kvtier server, no engine.

Stories: a prompt is stored and a second request loads it; vLLM already holds part of it;
chunks come up from disk; chunks vanish, are corrupt, come late, or the server is gone;
a request is aborted while its load waits; two ranks must both confirm a store.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from rig import BLOCK, CHUNK, FakeEngine, empty_step, step_for
from store_helpers import disk_files, wait_until

from kvtier.config import ServerConfig
from kvtier.hints import FinishRetention, Retain, RetentionHint, TokenRange
from kvtier.keys import chunk_keys
from kvtier.protocol import Report
from kvtier.server import EmbeddedServer, NodeServer
from kvtier.vllm import scheduler

PROMPT = list(range(100, 200))  # 100 tokens: 3 full chunks of 32, 7 blocks of 16


def stored_prompt(engine: FakeEngine, tokens: list[int] = PROMPT, *,
                  server: NodeServer | None = None, **kw: Any) -> dict[str, Any]:
    """Run a prompt to the end; with ``server``, wait for its lower-tier writes too."""
    req = engine.add(tokens, **kw)
    engine.run(req)
    params = engine.finish(req)
    if server is not None:
        assert server.store is not None and server.store.flush(5)
    return params


def pushed_to_disk(engine: FakeEngine, server: NodeServer) -> None:
    """Store PROMPT, then another prompt that pushes it out of a 4-slot arena."""
    stored_prompt(engine, server=server)
    stored_prompt(engine, [t + 1000 for t in PROMPT], server=server)


def test_second_request_loads_what_the_first_stored(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    first = stored_prompt(engine)
    assert first["stored_chunks"] == 3
    assert first["tokens"] == {"device": 0, "recomputed": 100}

    req = engine.add(PROMPT)
    assert engine.hit(req) == 3 * CHUNK
    plan = engine.step()
    assert [job.req_id for job in plan.loads] == [req]
    assert engine.finished_loads == {req} and not engine.failed_blocks
    assert engine.blocks_match_recompute(req, 3 * CHUNK // BLOCK)
    engine.run(req)
    params = engine.finish(req)
    assert params["tokens"] == {"device": 0, "arena": 96, "recomputed": 4}
    assert server.store is not None and server.store.stats()["leases"] == 0
    server.store.check_integrity()


def test_only_blocks_beyond_the_local_hit_are_loaded(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    req = engine.add(PROMPT, local_blocks=3)  # 48 tokens: chunk 1 is half local
    assert engine.hit(req) == 96
    plan = engine.step()
    (job,) = plan.loads
    assert len(job.block_ids) == 3 and job.positions == [1, 0, 1]
    assert engine.blocks_match_recompute(req, 6)
    engine.run(req)
    tokens = engine.finish(req)["tokens"]
    assert tokens == {"device": 48, "arena": 48, "recomputed": 4}
    assert sum(tokens.values()) == len(PROMPT)


def test_cache_salt_isolates_tenants(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine, salt="tenant-a")
    assert engine.hit(engine.add(PROMPT, salt="tenant-b")) == 0
    assert engine.hit(engine.add(PROMPT, salt="tenant-a")) == 96


def test_chunks_are_promoted_from_disk(make_server: Any, engines: Any, tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server)
    pushed_to_disk(engine, server)
    assert len(disk_files(tmp_path)) == 6
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96
    for _ in range(200):
        if engine.step().loads:
            break
        time.sleep(0.005)
    assert engine.finished_loads == {req} and not engine.failed_blocks
    assert engine.blocks_match_recompute(req, 6)
    engine.run(req)
    tokens = engine.finish(req)["tokens"]
    assert tokens.get("disk", 0) > 0 and sum(tokens.values()) == len(PROMPT)


def test_corrupt_chunk_on_disk_is_recomputed(make_server: Any, engines: Any,
                                             tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server)
    pushed_to_disk(engine, server)
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    path = disk_files(tmp_path)[keys[1].hex()]
    data = bytearray(path.read_bytes())
    data[5000] ^= 0xFF  # a payload byte: the checksum catches it
    path.write_bytes(bytes(data))
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96
    assert wait_until(lambda: bool(engine.step().loads) or not engine.reqs[req].loading)
    assert engine.reqs[req].computed == CHUNK  # chunk 0 loaded, from chunk 1 on: recompute
    engine.run(req)
    assert engine.blocks_match_recompute(req, 6)
    tokens = engine.finish(req)
    assert tokens["failed_load_tokens"] == 64
    assert sum(tokens["tokens"].values()) == len(PROMPT)


def test_server_gone_between_lookup_and_lease(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine)
    req_id = "late"
    engine.sched.track(_info(req_id, PROMPT))
    assert engine.sched.num_new_matched_tokens(req_id, 0) == 96
    server.stop(drain_s=1)
    engine.sched.after_alloc(req_id, list(range(1, 8)), 96)
    plan = engine.sched.build_plan(empty_step())
    (job,) = plan.loads
    assert job.block_ids == [] and job.failed_block_ids == list(range(1, 7))
    assert engine.sched.link.failures >= 1


def test_engine_keeps_working_while_server_is_down(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    socket = server.socket_path
    server.stop(drain_s=1)
    req = engine.add(PROMPT)
    assert engine.hit(req) == 0
    engine.run(req)
    assert engine.finish(req)["stored_chunks"] == 0
    assert not engine.sched.has_pending_work()
    restarted = make_server(slots=16, socket_path=socket)
    time.sleep(0.1)  # past the retry interval
    assert stored_prompt(engine)["stored_chunks"] == 3
    assert engine.hit(engine.add(PROMPT)) == 96
    assert restarted.store is not None
    restarted.store.check_integrity()


def test_abort_while_load_waits_still_reports_it(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server, hold_loads_s=60.0)
    stored_prompt(engine)
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96 and not engine.step().loads  # held back
    engine.finish(req)
    plan = engine.step()
    assert [(j.req_id, j.block_ids) for j in plan.loads] == [(req, [])]
    assert req in engine.finished_loads
    assert not engine.sched.has_pending_work()
    assert engine.sched.take_counters()["cancelled_loads"] == 1
    assert server.store is not None and server.store.stats()["leases"] == 0


def test_late_promotion_times_out_into_recompute(make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server, load_timeout_s=0.0001)
    pushed_to_disk(engine, server)
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96
    time.sleep(0.001)
    engine.step()
    assert req in engine.finished_loads
    engine.run(req)
    assert engine.blocks_match_recompute(req, 6)
    assert sum(engine.finish(req)["tokens"].values()) == 100


def test_store_commits_only_when_every_rank_confirmed(tmp_path: Path, engines: Any) -> None:
    config = ServerConfig.from_dict({
        "socket_path": str(tmp_path / "tp.sock"),
        "arena": {"size_bytes": 16 * 3 * 4096, "slot_bytes": 3 * 4096}})
    with EmbeddedServer(config) as server:
        engine = engines(server, tp=2)
        req = engine.add(PROMPT)
        plan = engine.sched.build_plan(step_for(engine, req))
        assert len(plan.stores) == 3
        engine.compute(engine.reqs[req], 0, len(PROMPT))
        rank0, rank1 = engine.workers
        rank0.save(plan.stores)
        engine.sched.on_worker_output(set(), rank0.take_report())
        assert engine.sched.has_pending_work()
        assert engine.hit(engine.add(PROMPT)) == 0  # half-written chunks are not served
        rank1.save(plan.stores)
        engine.sched.on_worker_output(set(), rank1.take_report())
        assert not engine.sched.has_pending_work()
        other = engine.add(PROMPT)
        assert engine.hit(other) == 96
        engine.run(other)
        assert engine.blocks_match_recompute(other, 6)  # both ranks' pages came back


def test_worker_with_another_arena_fails_the_store(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    req = engine.add(PROMPT)
    plan = engine.sched.build_plan(step_for(engine, req))
    for job in plan.stores:
        job.arena = "not-this-one"
    engine.run_workers(plan)
    assert not engine.sched.has_pending_work()
    assert server.store is not None and server.store.stats()["entries"] == 0


def _info(req_id: str, tokens: list[int]) -> Any:
    from kvtier.vllm.tracking import RequestInfo

    return RequestInfo(req_id, tuple(tokens), ())




def test_worker_shakes_hands_again_after_a_server_restart(make_server: Any,
                                                         engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    socket = server.socket_path
    stored_prompt(engine)  # the worker now holds a connection to this server
    server.stop(drain_s=1)
    make_server(slots=16, socket_path=socket)
    time.sleep(0.1)
    assert stored_prompt(engine)["stored_chunks"] == 3  # worker copies into the new arena
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96
    engine.run(req)
    assert engine.blocks_match_recompute(req, 6) and not engine.failed_blocks


def test_a_failed_load_is_not_offered_again(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    req = engine.add(PROMPT)
    plan = engine.sched.build_plan(empty_step())
    for job in plan.loads:
        job.arena = "gone"  # the worker cannot serve it: every block fails
    engine.run_workers(plan)
    assert engine.reqs[req].computed == 0 and engine.failed_blocks
    # vLLM re-admits a request whose whole load failed; kvtier must not offer it again.
    assert engine.sched.num_new_matched_tokens(req, 0) == 0
    acct = engine.finish(req)
    assert acct["failed_load_tokens"] == 96 and "arena" not in acct["tokens"]


def test_an_unplanned_load_fails_every_block(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    engine.sched.track(_info("odd", PROMPT))
    engine.sched.after_alloc("odd", [5, 6, 7], 48)  # no lookup answered this
    (job,) = engine.sched.build_plan(empty_step()).loads
    assert job.block_ids == [] and job.failed_block_ids == [5, 6, 7]


def test_request_priority_reaches_the_stored_chunks(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine, priority=90)
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    assert server.store is not None
    assert [server.store.entries[k].priority for k in keys] == [90, 90, 90]
    stored_prompt(engine, priority=10)  # a later request of the shared prefix never lowers
    assert [server.store.entries[k].priority for k in keys] == [90, 90, 90]
    stored_prompt(engine, release=True)  # only a release does
    assert [server.store.entries[k].priority for k in keys] == [0, 0, 0]


def test_a_shorter_retention_leaves_a_longer_one_on_a_shared_prefix(
        make_server: Any, engines: Any) -> None:
    """Scenario: one request keeps a shared prefix at 80 for 60 s; another of the same
    prefix asks 80 for 5 s, a third plain priority 20: the 60 s stay. A later, longer one
    extends it."""
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine, retention=RetentionHint(priority=80, duration_s=60.0))
    store = server.store
    assert store is not None
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    first = [store.index.policy.retention(k) for k in keys]
    assert {r[0] for r in first if r} == {80}
    stored_prompt(engine, retention=RetentionHint(priority=80, duration_s=5.0))
    stored_prompt(engine, priority=20)
    assert [store.index.policy.retention(k) for k in keys] == first
    stored_prompt(engine, retention=RetentionHint(priority=80, duration_s=120.0))
    later = [store.index.policy.retention(k) for k in keys]
    for a, b in zip(first, later, strict=True):
        assert a and b and a[1] and b[1] and b[1] > a[1] + 50


def test_a_request_retention_reaches_each_range_and_a_release_drops_it(
        make_server: Any, engines: Any) -> None:
    """TensorRT-LLM's shape: the first chunk (a system prompt) kept at 90 for 60 s, the
    rest of the prompt at 50 for 5 s; then a later request of the same prefix releases it."""
    server = make_server(slots=16)
    engine = engines(server)
    hint = RetentionHint(priority=50, duration_s=5.0,
                         ranges=(TokenRange(priority=90, start=0, end=CHUNK, duration_s=60.0),))
    stored_prompt(engine, retention=hint)
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    store = server.store
    assert store is not None
    held = [store.index.policy.retention(k) for k in keys]
    assert [r[0] for r in held if r] == [90, 50, 50]
    deadlines = [r[1] for r in held if r]
    assert all(d is not None for d in deadlines)
    assert deadlines[0] - deadlines[1] == pytest.approx(55.0, abs=1.0)  # type: ignore[operator]
    assert store.index.policy.order()[-3:] == keys[::-1]  # the head last: tail first
    stored_prompt(engine, release=True)
    assert [store.index.policy.retention(k) for k in keys] == [(0, None)] * 3


def test_the_retention_for_how_a_request_ended_is_set_when_it_ends(
        make_server: Any, engines: Any) -> None:
    """The router's session retention: a turn that stops keeps its prefix at 60 for 600 s
    from its end; one cut by ``length`` or aborted, which has no entry, keeps what it has;
    a weaker finish retention never lowers a stronger one held by another request."""
    server = make_server(slots=16)
    engine = engines(server)
    store = server.store
    assert store is not None
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    finish = FinishRetention(stop=Retain(60, 600.0))
    req = engine.add(PROMPT, finish=finish)
    engine.run(req)
    engine.finish(req, "abort")
    assert [store.index.policy.retention(k) for k in keys] == [(35, None)] * 3
    before = time.monotonic()
    stored_prompt(engine, finish=finish)
    held = [store.index.policy.retention(k) for k in keys]
    assert [r[0] for r in held if r] == [60, 60, 60]
    assert all(r and r[1] and r[1] >= before + 599 for r in held)
    assert store.index.policy.order()[-3:] == keys[::-1]  # the head last: tail first
    stored_prompt(engine, finish=FinishRetention(stop=Retain(40, 5.0), length=Retain(90)),)
    assert [store.index.policy.retention(k) for k in keys] == held


def test_the_scheduler_side_registers_its_namespace_with_each_server_start(
        make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine)  # a step reports, and registers first
    assert server.service is not None
    info = server.service.namespaces[engine.sched.ns.fingerprint]
    assert info["chunk_tokens"] == CHUNK and info["namespace"] == engine.sched.ns.short


def test_a_finish_reports_to_the_server_only_when_the_engine_goes_idle(
        make_server: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report is a round trip to the node server in vLLM's scheduler loop: a request that
    finishes beside another running one leaves its counters to the periodic report (the
    engine keeps stepping); the last one to finish reports at once."""
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine)  # registered, and a first report made
    link = engine.sched.link
    sent: list[str] = []
    call = link.call

    def recording(request: Any, default: Any, undo: Any = None) -> Any:
        sent.append(type(request).__name__)
        return call(request, default, undo)

    monkeypatch.setattr(link, "call", recording)
    monkeypatch.setattr(scheduler, "REPORT_EVERY_S", 3600.0)  # no periodic report due
    monkeypatch.setattr(engine.sched, "_reported_at", engine.sched.clock())
    first = engine.add([t + 3000 for t in PROMPT])
    second = engine.add([t + 4000 for t in PROMPT])
    engine.run(first)
    engine.run(second)
    engine.finish(first)
    assert Report.__name__ not in sent, "the second still runs: no round trip for the first"
    engine.finish(second)
    assert sent.count(Report.__name__) == 1, "the last one to finish reports"
