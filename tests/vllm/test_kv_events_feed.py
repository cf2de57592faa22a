"""kvtier's tiers in vLLM's KV-event stream, engine-free: the connector's scheduler side
against a real node server, its events translated by :class:`KvEventFeed`.

Stories: a stored prompt is announced in the arena (CPU) with vLLM's block hashes, then in
the disk tier (STORAGE, LOCAL) and a shared folder (STORAGE, REMOTE); pushed out of the
arena it is taken back; loaded again from disk it is announced in the arena again; a server
restart and a log that dropped events take back everything and announce again what is held.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rig import BLOCK, CHUNK, FakeEngine, block_hashes
from store_helpers import tier_config
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.server import NodeServer
from kvtier.vllm.kv_events import KvEventFeed
from kvtier.vllm.link import ServerLink

PROMPT = list(range(100, 200))  # 3 chunks of 32 tokens = 6 blocks of 16
OTHER = [t + 1000 for t in PROMPT]


def tiers(root: Path) -> list[dict[str, Any]]:
    shared = {"type": "fs", "name": "shared", "capacity_bytes": 1 << 20,
              "options": {"path": str(root / "shared"), "journal_interval_s": 0.05,
                          "poll_s": 0.05, "sweep_interval_s": 600}}
    return [tier_config(root, 1 << 20), shared]


def engine_with_feed(server: NodeServer, **kw: Any) -> FakeEngine:
    """A rig engine whose scheduler side feeds a KvEventFeed polled on every take()."""
    def feed(link: ServerLink) -> KvEventFeed:
        return KvEventFeed(link, namespace_fp(), BLOCK, CHUNK, interval_s=0.0, **kw)

    return FakeEngine(server.socket_path, feed=feed)


def namespace_fp() -> bytes:
    from rig import namespace

    return namespace().fingerprint


def hashes(tokens: list[int], chunks: range) -> list[int]:
    bh = block_hashes(tokens)
    return [maybe_convert_block_hash(h) for c in chunks for h in bh[2 * c:2 * c + 2]]  # type: ignore[arg-type]


def stored(events: list[Any], medium: str) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]


def removed(events: list[Any], medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium
            for h in e.block_hashes]


def run_prompt(engine: FakeEngine, server: NodeServer, tokens: list[int]) -> None:
    req = engine.add(tokens)
    engine.run(req)
    engine.finish(req)
    assert server.store is not None and server.store.flush(5)


def test_a_stored_prompt_is_announced_per_tier_with_vllm_block_hashes(
        make_server: Any, tmp_path: Path) -> None:
    server = make_server(slots=8, tiers=tiers(tmp_path))
    engine = engine_with_feed(server)
    run_prompt(engine, server, PROMPT)
    assert engine.events is not None
    events = engine.events.take()
    cpu = sorted(stored(events, "CPU"), key=lambda e: e.token_ids[0])  # any order
    assert [e.block_hashes for e in cpu] == [hashes(PROMPT, range(c, c + 1)) for c in range(3)]
    bh = [maybe_convert_block_hash(h) for h in block_hashes(PROMPT)]  # type: ignore[arg-type]
    assert [e.parent_block_hash for e in cpu] == [None, bh[1], bh[3]]
    assert [e.token_ids for e in cpu] == [PROMPT[c * CHUNK:(c + 1) * CHUNK] for c in range(3)]
    assert {(e.block_size, e.locality, e.ownership, e.group_idx) for e in cpu} == {
        (BLOCK, "LOCAL", None, 0)}
    storage = stored(events, "STORAGE")
    by_tier = {(e.ownership, e.locality): {h for s in storage if s.ownership == e.ownership
                                           for h in s.block_hashes} for e in storage}
    assert by_tier == {("disk", "LOCAL"): set(hashes(PROMPT, range(3))),
                       ("shared", "REMOTE"): set(hashes(PROMPT, range(3)))}
    assert engine.events.take() == [], "nothing new: nothing announced twice"
    engine.close()


def test_pushed_out_of_the_arena_is_taken_back_and_a_load_announces_it_again(
        make_server: Any, tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20)
    engine = engine_with_feed(server)
    assert engine.events is not None
    run_prompt(engine, server, PROMPT)
    engine.events.take()
    run_prompt(engine, server, OTHER)  # 3 more chunks into a 4-slot arena
    events = engine.events.take()
    gone = removed(events, "CPU")
    assert gone and set(gone) <= set(hashes(PROMPT, range(3)))
    assert removed(events, "STORAGE") == [], "the disk tier still holds it"
    # loading it back from disk puts it in the arena again: announced again
    req = engine.add(PROMPT)
    engine.run(req)
    engine.finish(req)
    again = stored(engine.events.take(), "CPU")
    assert {h for e in again for h in e.block_hashes} >= set(gone)
    engine.close()


def test_a_restarted_server_takes_back_everything_and_announces_what_is_held(
        make_server: Any, tmp_path: Path) -> None:
    server = make_server(slots=8, disk_bytes=1 << 20)
    engine = engine_with_feed(server)
    assert engine.events is not None
    run_prompt(engine, server, PROMPT)
    engine.events.take()
    server.stop(drain_s=5)
    make_server(slots=8, disk_bytes=1 << 20)  # same socket and disk folder, empty arena
    events = engine.events.take()
    assert sorted(removed(events, "CPU")) == sorted(hashes(PROMPT, range(3)))
    assert sorted(removed(events, "STORAGE")) == sorted(hashes(PROMPT, range(3)))
    # the new server indexed the disk tier: its chunks are announced again, not the arena's
    assert {h for e in stored(events, "STORAGE") for h in e.block_hashes} == set(
        hashes(PROMPT, range(3)))
    assert stored(events, "CPU") == []
    engine.close()


def test_a_log_that_dropped_unread_events_takes_back_everything(
        make_server: Any, tmp_path: Path) -> None:
    from collections import deque

    server = make_server(slots=16)
    engine = engine_with_feed(server)
    assert engine.events is not None and server.store is not None
    run_prompt(engine, server, PROMPT)
    assert len(stored(engine.events.take(), "CPU")) == 3
    # A real log of 4 events (the default holds 65536): the next prompt overflows it.
    server.store.events._events = deque(server.store.events._events, maxlen=4)
    run_prompt(engine, server, OTHER)
    run_prompt(engine, server, [t + 2000 for t in PROMPT])
    events = engine.events.take()
    assert sorted(removed(events, "CPU")) == sorted(hashes(PROMPT, range(3))), \
        "everything announced is taken back"
    # ... and what the log still has (the newest 4 stores) is announced again
    assert {h for e in stored(events, "CPU") for h in e.block_hashes} <= set(
        hashes(OTHER, range(3))) | set(hashes([t + 2000 for t in PROMPT], range(3)))
    assert stored(events, "CPU")
    engine.close()


def test_the_book_is_bounded_and_unknown_chunks_are_counted(
        make_server: Any, tmp_path: Path) -> None:
    server = make_server(slots=16)
    engine = engine_with_feed(server, capacity=2)
    assert engine.events is not None
    run_prompt(engine, server, PROMPT)
    events = engine.events.take()
    assert len(engine.events.book) == 2
    assert len(stored(events, "CPU")) == 2 and engine.events.untranslated == 1
    engine.close()
