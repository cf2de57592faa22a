"""The simulator and the live store agree on the same access sequence.

Both take every decision through the placement core (kvtier/store/placement.py, tested on its
own in tests/store/test_placement.py); what this pins is the rest, each one's sequence of
steps (which chunks are leased, pinned or copied when, and when the I/O lands), so that fed
the same accesses they end with the same tier contents.

A generated chat trace (sessions over shared system prompts, prompts cut to 8 blocks) is
replayed twice: through :class:`~kvtier.trace.simulate.Simulator` with a host of H chunks and
a disk of D chunks, and through a real :class:`~kvtier.store.TieredStore` with an arena of H
slots and a disk tier of D chunks' bytes, doing what an engine does per request::

    lease the prompt's keys -> wait for promotions -> release
    reserve the keys after the served prefix -> write the payloads -> commit

for LRU, ARC and S3-FIFO, with the disk write-through or write-back, with and without
``after_uses=2`` and an arena ``free_target``. Block id ``b`` becomes the key
``b.to_bytes(8) + 24 zero bytes``, so the store's ``after_uses`` rule (which counts
``key[:8]``) sees the ids the simulator's ``admission_key`` gives. The store's lower-tier
copies and deletes finish on an I/O thread after the step that started them; the simulator
completes them when that step ends, so the store is flushed after each step (without that,
ARC and S3-FIFO runs of the store differ from run to run: whether a copy has landed changes
what the next step may evict). Compared: per request, the served prefix and the tier of each
served block; at the end, the eviction order of host and arena and of both disks, hits and
evictions per tier. Capacities are small (H = 12, D = 30) so that both tiers evict all the
time. The hand-worked scenarios of test_trace_simulate that hinge on what a step pins or
writes back run here too.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from store_helpers import CHUNK_BYTES, NS, PAYLOAD, SLOT_BYTES, TOKENS, arena_name, pattern

from kvtier.codec import HEADER_SIZE
from kvtier.config import ServerConfig
from kvtier.keys import ChunkKey
from kvtier.store import ARENA, TieredStore
from kvtier.store.records import ItemState
from kvtier.tiers.arena import shm_path
from kvtier.trace.formats import Request
from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.hints import apply_hints
from kvtier.trace.simulate import HOST, Simulator, TierSpec, WritePolicy

H, D = 12, 30
MAX_BLOCKS = 8
Admission = tuple[tuple[str, int], ...]
AFTER_2: Admission = (("after_uses", 2),)


class Case(NamedTuple):
    requests: list[Request]
    host: int
    disk: int
    admission: Admission
    write: WritePolicy = "through"
    free_target: float = 0.0


class Replay(NamedTuple):
    served: list[list[str]]
    """Per request, the tier that served each block of its prefix (``arena`` or ``disk``)."""
    host_order: list[int]
    disk_order: list[int]
    hits: dict[str, int]
    evictions: dict[str, int]


def chat_trace() -> list[Request]:
    """About 300 requests of 1-8 blocks: 60 sessions, 4 system prompts, several turns each."""
    config = GenConfig(sessions=60, system_prompts=4, turns=5.0, system_prompt_tokens=192,
                       user_tokens=48, output_tokens=32, block_tokens=64, session_rate=0.5,
                       think_time_s=20.0, seed=7)
    return [_cut(r) for r in generate(config)]


def _cut(request: Request) -> Request:
    if len(request.blocks) <= MAX_BLOCKS:
        return request
    return dataclasses.replace(request, blocks=request.blocks[:MAX_BLOCKS],
                               input_tokens=MAX_BLOCKS * request.block_tokens)


def scenario(*blocks: list[int]) -> list[Request]:
    return [Request(float(i), len(b) * TOKENS, 1, tuple(b), TOKENS) for i, b in enumerate(blocks)]


SCENARIOS = {  # the test of test_trace_simulate each one comes from
    "copied_down_stays_in_host":
        Case(scenario([5], [2], [1, 2, 3], [1, 2, 3]), 2, 100, AFTER_2),
    "promoted_stays_in_its_tier":
        Case(scenario([1], [1], [1, 2], [3], [1, 2], [4], [5], [1, 2]), 2, 1, AFTER_2),
    "write_back_demotes_host_victims":
        Case(scenario([1], [2], [2], [1], [2]), 1, 100, (), "back"),
    "free_target_writes_back_ahead":
        Case(scenario([1], [2], [3], [1], [3]), 2, 100, (), "back", 0.5),
}
CONFIGS = {  # disk write policy, admission, arena free_target
    "through": ("through", (), 0.0),
    "through-after_uses=2": ("through", AFTER_2, 0.0),
    "back": ("back", (), 0.0),
    "back-after_uses=2-free_target=0.25": ("back", AFTER_2, 0.25),
}


def key_of(block: object) -> ChunkKey:
    assert isinstance(block, int)
    return ChunkKey(block.to_bytes(8, "big") + bytes(24))


def id_of(key: Any) -> int:
    return int.from_bytes(bytes(key)[:8], "big")


# ---------------------------------------------------------------------- the simulator

def simulator_replay(case: Case, eviction: str) -> Replay:
    specs = [TierSpec(HOST, case.host, eviction, free_target=case.free_target),
             TierSpec("disk", case.disk, eviction, admission=case.admission, write=case.write)]
    sim = Simulator(specs, block_tokens=TOKENS)
    served = [[ARENA if t == HOST else t for t in sim.request(r)] for r in case.requests]
    host, disk = sim.result().tiers
    return Replay(served, ids(sim.tiers[0].policy.order()), ids(sim.tiers[1].policy.order()),
                  {ARENA: host.hits, "disk": disk.hits},
                  {ARENA: host.evictions, "disk": disk.evictions})


def ids(order: list[Any]) -> list[int]:
    return [int(block) for block in order]


# ---------------------------------------------------------------------- the store

@pytest.fixture
def stores() -> Iterator[list[TieredStore]]:
    made: list[TieredStore] = []
    yield made
    for store in made:
        store.close(drain_s=5)
        assert not os.path.exists(shm_path(store.arena.name)), "arena left in /dev/shm"


class TraceClock:
    """The store's clock in a hinted replay: the arrival of the request replayed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(root: Path, case: Case, eviction: str, clock: TraceClock | None = None
          ) -> TieredStore:
    """An arena of ``case.host`` slots over a disk tier of ``case.disk`` chunks."""
    disk = {"type": "disk", "name": "disk", "capacity_bytes": case.disk * CHUNK_BYTES,
            "eviction": eviction, "admission": dict(case.admission) or "always",
            "write_policy": case.write, "io_threads": 1, "options": {"path": str(root / "disk")}}
    config = ServerConfig.from_dict({
        "socket_path": str(root / "unused.sock"),
        "arena": {"size_bytes": case.host * SLOT_BYTES, "slot_bytes": SLOT_BYTES,
                  "free_target": case.free_target, "eviction": eviction},
        "tiers": [disk],
    })
    if clock is None:
        return TieredStore(config, arena_name=arena_name())
    return TieredStore(config, arena_name=arena_name(), clock=clock)


def store_request(store: TieredStore, request: Request) -> list[str]:
    """One request as an engine makes it (with its hint, as the connector sends it: the
    retention at reserve, again or a release once answered); returns the tier of each
    served block."""
    if isinstance(store.clock, TraceClock):
        store.clock.now = request.ts_s
    priority, retain_s = request.retention or (35, None)
    keys = [key_of(b) for b in request.blocks]
    record = store.lease(1, keys)
    store.wait(record.lease_id, 10.0)
    assert all(item.state is ItemState.READY for item in record.items), "a promotion failed"
    served = [item.tier for item in record.items]
    assert store.flush()
    store.release(record.lease_id)
    rest = keys[len(served):]
    slots = store.reserve(1, NS, rest, payload_len=PAYLOAD, tokens=TOKENS,
                          first_index=len(served), priority=priority, retain_s=retain_s)
    assert store.flush()
    for key, slot in zip(rest, slots, strict=True):
        if slot is not None:
            store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + PAYLOAD] = pattern(key)
    store.commit([key for key, slot in zip(rest, slots, strict=True) if slot is not None])
    assert store.flush()
    if request.end:
        store.set_priority(keys, 0)
    elif request.retention is not None:
        store.set_priority(keys, priority, retain_s, keep_stronger=True)
    return served


def store_replay(store: TieredStore, requests: list[Request]) -> Replay:
    served = [store_request(store, r) for r in requests]
    store.check_integrity()
    return Replay(served, [id_of(k) for k in store.policy.order()],
                  [id_of(k) for k in store.tiers[0].policy.order()],
                  {tier: count(store, "kvtier_hits_total", tier=tier) for tier in (ARENA, "disk")},
                  {tier: count(store, "kvtier_evictions_total", tier=tier, cause="capacity")
                   for tier in (ARENA, "disk")})


def count(store: TieredStore, name: str, **labels: str) -> int:
    return int(store.metrics.registry.get_sample_value(name, labels) or 0)


# ---------------------------------------------------------------------- the comparison

def first_difference(sim: list[list[str]], live: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(sim, live, strict=True)):
        if a != b:
            return f"request {i}: simulator served {a}, store served {b}"
    return ""


def replay_both(root: Path, stores: list[TieredStore], case: Case, eviction: str,
                clock: TraceClock | None = None) -> Replay:
    """Replay ``case`` through both; assert they agree and return the simulator's replay."""
    sim = simulator_replay(case, eviction)
    store = build(root, case, eviction, clock)
    stores.append(store)
    live = store_replay(store, case.requests)
    assert first_difference(sim.served, live.served) == ""
    assert sim.host_order == live.host_order
    assert sim.disk_order == live.disk_order
    assert (sim.hits, sim.evictions) == (live.hits, live.evictions)
    return sim


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
def test_simulator_and_store_agree_on_a_chat_trace(
    tmp_path: Path, stores: list[TieredStore], eviction: str, config: str
) -> None:
    write, admission, free_target = CONFIGS[config]
    case = Case(chat_trace(), H, D, admission, write, free_target)  # type: ignore[arg-type]
    sim = replay_both(tmp_path, stores, case, eviction)
    # Only a check if both tiers filled up, evicted and served hits.
    assert len(sim.disk_order) == D
    assert min(*sim.hits.values(), *sim.evictions.values()) > 100


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
def test_simulator_and_store_agree_on_the_hand_worked_scenarios(
    tmp_path: Path, stores: list[TieredStore], eviction: str, name: str
) -> None:
    replay_both(tmp_path, stores, SCENARIOS[name], eviction)


@pytest.mark.parametrize("hints", ["continues:40", "continues:inf"])
@pytest.mark.parametrize("eviction", ["lru", "arc", "s3fifo"])
def test_simulator_and_store_agree_on_retention_hints(
    tmp_path: Path, stores: list[TieredStore], eviction: str, hints: str
) -> None:
    """The same oracle hints through the simulator and through the store's reserve and
    set_priority (retentions that expire on the trace's clock, releases): the same hits
    and the same orders, so what a replay says hints buy is what the store delivers."""
    requests = apply_hints(chat_trace(), hints)
    assert {r.end for r in requests} == {True, False}
    case = Case(requests, H, D, (), "through")
    sim = replay_both(tmp_path, stores, case, eviction, TraceClock())
    assert min(*sim.hits.values(), *sim.evictions.values()) > 50
