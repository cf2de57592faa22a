"""The scheduler side's books: what it stores again after a load, what its counters say,
and which blocks an unplanned load fails. Real server, no engine (see rig.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rig import BLOCK, CHUNK, FakeEngine, empty_step, step_for
from store_helpers import disk_files, sample, store_of, wait_until

from kvtier.keys import chunk_keys
from kvtier.server import NodeServer
from kvtier.vllm.tracking import RequestInfo

PROMPT = list(range(100, 200))  # 100 tokens: 3 full chunks of 32, 7 blocks of 16


def stored_prompt(engine: FakeEngine, tokens: list[int] = PROMPT) -> dict[str, Any]:
    req = engine.add(tokens)
    engine.run(req)
    return engine.finish(req)


def present_refusals(server: NodeServer) -> float:
    return sample(store_of(server), "kvtier_store_refusals_total", reason="present")


# ---------------------------------------------------------------------- stores after a load

def test_loaded_chunks_are_not_reserved_again(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    stored_prompt(engine)
    engine.sched.take_counters()
    refused = present_refusals(server)
    req = engine.add(PROMPT)
    assert engine.hit(req) == 96
    stores = []
    while engine.reqs[req].loading or engine.reqs[req].computed < len(PROMPT):
        stores += engine.step().stores
    assert stores == []  # no Reserve round trip for the 3 chunks it loaded
    assert engine.finish(req)["stored_chunks"] == 0
    counters = engine.sched.take_counters()
    assert counters["loaded_tokens|arena"] == 96 and "skipped_store_chunks" not in counters
    assert present_refusals(server) == refused  # no second "use" recorded server-side


def test_only_chunks_of_the_device_hit_are_reserved_again(make_server: Any,
                                                          engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    engine.sched.take_counters()
    req = engine.add(PROMPT, local_blocks=3)  # chunk 0 from vLLM's cache, 1-2 from kvtier
    engine.run(req)
    engine.finish(req)
    # chunk 0 is not known to be in kvtier: it is reserved (and found present), 1-2 are not
    assert engine.sched.take_counters()["skipped_store_chunks"] == 1


def test_a_load_the_worker_failed_is_stored_again(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    engine.sched.take_counters()
    req = engine.add(PROMPT)
    plan = engine.sched.build_plan(empty_step())
    for job in plan.loads:
        job.arena = "gone"  # the worker cannot serve it: every block fails, vLLM recomputes
    engine.run_workers(plan)
    engine.run(req)
    engine.finish(req)
    # recomputed, so offered to kvtier again (all 3 are still there: found present)
    assert engine.sched.take_counters()["skipped_store_chunks"] == 3


def test_chunks_after_a_failed_one_are_stored_again(make_server: Any, engines: Any,
                                                    tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server)
    stored_prompt(engine)
    assert store_of(server).flush(5)
    stored_prompt(engine, [t + 1000 for t in PROMPT])  # pushes PROMPT to disk
    assert store_of(server).flush(5)
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    path = disk_files(tmp_path)[keys[1].hex()]
    data = bytearray(path.read_bytes())
    data[5000] ^= 0xFF  # chunk 1 is corrupt: 0 is loaded, 1 and 2 are recomputed
    path.write_bytes(bytes(data))
    engine.sched.take_counters()
    req = engine.add(PROMPT)
    assert wait_until(lambda: bool(engine.step().loads) or not engine.reqs[req].loading)
    engine.run(req)
    acct = engine.finish(req)
    assert acct["failed_load_tokens"] == 64
    assert acct["stored_chunks"] == 1  # chunk 1 (dropped as corrupt) is stored anew
    assert engine.sched.take_counters()["skipped_store_chunks"] == 1  # chunk 2, still on disk
    assert engine.hit(engine.add(PROMPT)) == 96


# ---------------------------------------------------------------------- counters

def test_query_tokens_count_misses_once_per_request(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    engine.add(PROMPT)  # a miss; the rig asks twice, as vLLM does for a waiting request
    assert engine.sched.take_counters()["query_tokens"] == 100
    engine.add([t + 1 for t in PROMPT], local_blocks=3)
    assert engine.sched.take_counters()["query_tokens"] == 100 - 3 * BLOCK


def test_hit_tokens_count_only_what_kvtier_provides(make_server: Any, engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    engine.sched.take_counters()
    req = engine.add(PROMPT, local_blocks=3)  # chunk 1 is half in vLLM's own hit
    engine.run(req)
    counters = engine.sched.take_counters()
    assert counters["query_tokens"] == 100 - 48
    assert counters["hit_tokens|arena"] == 48 == counters["loaded_tokens|arena"]


def test_a_requests_stored_chunks_are_those_handed_to_the_workers(make_server: Any,
                                                                  engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    req = engine.add(PROMPT)
    plan = engine.sched.build_plan(step_for(engine, req))
    for job in plan.stores:
        job.arena = "not-this-one"  # every copy fails: the chunks are aborted
    engine.run_workers(plan)
    assert engine.finish(req)["stored_chunks"] == 3  # as documented: handed out, not commits
    counters = engine.sched.take_counters()
    assert counters["failed_store_chunks"] == 3 and "stored_chunks" not in counters
    assert store_of(server).stats()["entries"] == 0


# ---------------------------------------------------------------------- unplanned loads

def test_an_unplanned_load_fails_only_blocks_beyond_the_device_hit(make_server: Any,
                                                                   engines: Any) -> None:
    engine = engines(make_server(slots=16))
    stored_prompt(engine)
    engine.sched.track(RequestInfo("odd", tuple(PROMPT), ()))
    assert engine.sched.num_new_matched_tokens("odd", 3 * BLOCK) == 48
    blocks = [11, 12, 13, 14, 15, 16, 17]
    engine.sched.after_alloc("odd", blocks, 32)  # not the 48 planned
    (job,) = engine.sched.build_plan(empty_step()).loads
    # blocks 0-2 are vLLM's own (maybe shared with running requests): never failed
    assert job.block_ids == [] and job.failed_block_ids == [14, 15]
    acct = engine.sched.request_finished("odd")
    assert acct is not None and acct["kvtier"]["tokens"]["device"] == 48  # type: ignore[index]
