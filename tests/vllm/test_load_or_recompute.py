"""Load or recompute: a hit is loaded only when it arrives before recomputing it would end.

The decision itself (hand-computed cases), the engine's prefill meter, and both sides of it
through the connector's scheduler side against a real server whose disk tier has been
measured: an engine that recomputes "instantly" skips the disk hit and counts it, one that
recomputes slowly loads it.
"""

from __future__ import annotations

from typing import Any

import pytest
from rig import CHUNK
from store_helpers import sample
from test_connector_sides import PROMPT, pushed_to_disk, stored_prompt

from kvtier.server import NodeServer
from kvtier.vllm.recompute import PrefillMeter, choose


def test_the_cut_maximises_recompute_time_saved_minus_arrival() -> None:
    tiers = ["arena", "arena", "disk", "disk"]
    arrivals = [0.0, 0.0, 0.5, 1.0]
    # 1000 tok/s: gains 0.256, 0.512, 0.268, 0.024 -> load two chunks, recompute the rest
    choice = choose(tiers, arrivals, start_chunk=0, local_tokens=0, chunk_tokens=256,
                    prefill_tokens_per_s=1000.0)
    assert choice.tiers == ["arena", "arena"] and choice.skipped == {"disk": 512}
    # 100 tok/s: recompute is slow, every chunk pays (gain of all four: 10.24 - 1.0)
    slow = choose(tiers, arrivals, start_chunk=0, local_tokens=0, chunk_tokens=256,
                  prefill_tokens_per_s=100.0)
    assert slow.tiers == tiers and slow.skipped == {}
    # unknown prefill speed: load everything, learn later
    assert choose(tiers, arrivals, start_chunk=0, local_tokens=0, chunk_tokens=256,
                  prefill_tokens_per_s=None).tiers == tiers


def test_a_partly_local_first_chunk_counts_only_its_new_tokens() -> None:
    # vLLM holds 300 tokens; the hit starts at chunk 1 (tokens 256..511): 212 new tokens
    choice = choose(["disk", "disk"], [1.0, 2.0], start_chunk=1, local_tokens=300,
                    chunk_tokens=256, prefill_tokens_per_s=1000.0)
    assert choice.tiers == [] and choice.skipped == {"disk": 212 + 256}


def test_the_prefill_meter_takes_the_median_of_busy_steps() -> None:
    meter = PrefillMeter(min_tokens=256)
    assert meter.tokens_per_s() is None
    meter.step(0.0, 1000)
    meter.step(0.5, 1000)   # the step before computed 1000 tokens in 0.5 s
    meter.step(1.0, 10)     # again; and this one computes too few tokens to count
    meter.step(1.1, 1000)
    meter.step(11.1, 1000)  # 1000 tokens "in 10 s": the engine idled in between
    meter.step(11.6, 1000)
    meter.step(12.1, 0)
    assert meter.tokens_per_s() == pytest.approx(2000.0), "the idle gap is outvoted"


def measured_disk(server: NodeServer, engines: Any) -> None:
    """PROMPT on disk, and one load from it measured (so the server has an estimate)."""
    patient = engines(server, load_or_recompute=False)
    pushed_to_disk(patient, server)
    req = patient.add(PROMPT)
    patient.run(req)
    params = patient.finish(req)
    assert params["tokens"].get("disk", 0) > 0, params
    assert server.store is not None
    assert server.store.tiers[0].reads.chunk_s(server.store.clock()) is not None
    stored_prompt(patient, [t + 2000 for t in PROMPT], server=server)  # out of the arena
    stored_prompt(patient, [t + 3000 for t in PROMPT], server=server)


def test_a_hit_slower_than_recompute_is_recomputed_and_counted(
        make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    measured_disk(server, engines)
    assert server.store is not None and server.store.lookup_hit([]).tiers == []
    hasty = engines(server, prefill_tokens_per_s=1e12)  # recompute costs nothing
    req = hasty.add(PROMPT)
    assert hasty.hit(req) == 0, "not worth loading"
    hasty.run(req)
    params = hasty.finish(req)
    assert params["tokens"]["recomputed"] == 100
    assert params["skipped_slower_than_recompute"] == {"disk": 3 * CHUNK}
    assert sample(server, "kvtier_engine_events_total", client=f"vllm-{hasty.sched.ns.short[:8]}",
                  event="skipped_slower_than_recompute", tier="disk") == 3 * CHUNK


def test_a_hit_faster_than_recompute_is_loaded(make_server: Any, engines: Any) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    measured_disk(server, engines)
    careful = engines(server, prefill_tokens_per_s=1.0)  # one token a second
    req = careful.add(PROMPT)
    assert careful.hit(req) == 3 * CHUNK
    careful.run(req)
    params = careful.finish(req)
    assert params["tokens"]["disk"] == 96 and params["skipped_slower_than_recompute"] == {}
