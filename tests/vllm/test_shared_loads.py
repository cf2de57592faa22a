"""Agents that fork, at the connector: requests for a prefix another request of this engine is
loading wait for that load ("ask again later") and then take vLLM's own prefix hit on its
blocks; a failed load lets them recompute, a slow one lets them go on their own in time.

Real scheduler and worker sides and a real node server with a disk tier, no engine
(tests/vllm/rig.py); where vLLM's prefix cache would hold the first request's blocks, the
test asks with that request's tokens as vLLM's own hit.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rig import CHUNK, FakeEngine
from store_helpers import disk_files, sample, wait_until

from kvtier.keys import chunk_keys
from kvtier.server import NodeServer
from kvtier.vllm.config import RequestOptions
from kvtier.vllm.tracking import RequestInfo

PROMPT = list(range(100, 200))  # 3 full chunks of 32
HIT = 3 * CHUNK


def on_disk(engine: FakeEngine, server: NodeServer) -> None:
    """PROMPT stored, then pushed out of the 4-slot arena by two other prompts."""
    for tokens in (PROMPT, [t + 1000 for t in PROMPT], [t + 2000 for t in PROMPT]):
        req = engine.add(tokens)
        engine.run(req)
        engine.finish(req)
        assert server.store is not None and server.store.flush(5)
    assert server.store.lookup(chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)) \
        == ["disk"] * 3


def sibling(engine: FakeEngine, req_id: str) -> str:
    engine.sched.track(RequestInfo(req_id, tuple(PROMPT), (), RequestOptions()))
    return req_id


def disk_reads(server: NodeServer) -> float:
    assert server.store is not None
    return sample(server.store, "kvtier_bytes_total", tier="disk", direction="read")


def test_siblings_wait_for_the_first_load_and_take_its_blocks(
        make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server, hold_loads_s=0.3)
    on_disk(engine, server)
    read_before = disk_reads(server)
    first = engine.add(PROMPT)
    assert engine.hit(first) == HIT
    siblings = [sibling(engine, f"sub-{i}") for i in range(3)]
    for _ in range(3):  # vLLM asks every step while they wait
        assert [engine.sched.num_new_matched_tokens(s, 0) for s in siblings] == [None] * 3
    engine.run(first)
    assert engine.blocks_match_recompute(first, HIT // 16)
    # vLLM cached the first request's blocks: each sibling's own hit covers the chain
    assert [engine.sched.num_new_matched_tokens(s, HIT) for s in siblings] == [0] * 3
    counters = engine.sched.counters.take()
    assert counters["shared_load_waits"] == 3
    loaded = sum(v for k, v in counters.items() if k.startswith("loaded_tokens"))
    assert loaded == HIT, "the chain was loaded once, for the first request"
    assert disk_reads(server) > read_before and server.store is not None
    assert server.store.stats()["leases"] == 0
    assert len(engine.sched.shared) == 0, "no load in flight is remembered"
    engine.finish(first)
    for s in siblings:
        assert engine.sched.request_finished(s) is None
    server.store.check_integrity()


def test_a_sibling_waits_at_most_the_load_timeout_then_joins_the_read(
        make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server, hold_loads_s=30.0, load_timeout_s=0.3)
    on_disk(engine, server)
    first = engine.add(PROMPT)
    late = sibling(engine, "late")
    began = time.monotonic()
    assert engine.sched.num_new_matched_tokens(late, 0) is None
    assert wait_until(lambda: engine.sched.num_new_matched_tokens(late, 0) is not None, 5.0)
    assert time.monotonic() - began < 3.0
    assert engine.sched.num_new_matched_tokens(late, 0) == HIT, "on its own: the same hit"
    engine.finish(first)
    assert engine.sched.request_finished(late) is None


def test_a_failed_first_load_lets_its_siblings_recompute(
        make_server: Any, engines: Any, tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server, hold_loads_s=0.2)
    on_disk(engine, server)
    keys = chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)
    disk_files(tmp_path)[keys[1].hex()].unlink()
    first = engine.add(PROMPT)
    sub = sibling(engine, "sub")
    assert engine.sched.num_new_matched_tokens(sub, 0) is None
    assert wait_until(lambda: bool(engine.step().loads) or not engine.reqs[first].loading, 5.0)
    assert wait_until(lambda: not engine.reqs[first].loading, 5.0)
    assert engine.reqs[first].computed == CHUNK, "chunk 0 loaded, the rest failed"
    # vLLM cached the one block-run the first request loaded; the rest is a miss now
    assert engine.sched.num_new_matched_tokens(sub, CHUNK) == 0
    engine.finish(first)
    assert engine.sched.request_finished(sub) is None


def test_without_sharing_siblings_lease_at_once(make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engines(server, hold_loads_s=0.3, share_loads=False)
    on_disk(engine, server)
    first = engine.add(PROMPT)
    sub = sibling(engine, "sub")
    assert engine.sched.num_new_matched_tokens(sub, 0) == HIT
    engine.finish(first)
    assert engine.sched.request_finished(sub) is None
