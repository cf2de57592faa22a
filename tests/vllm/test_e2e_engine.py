"""One vLLM engine with the kvtier connector, end to end (vLLM CPU build, float32, greedy).

The story, in order: a first round of long prompts is computed and stored; with vLLM's own
cache reset, a second round is served from the arena; with the server restarted on a tiny
arena, from disk; a corrupted chunk on disk and a killed server both fall back to
recomputing, with the right tokens; under a full device cache requests are preempted and
come back correct. Every round's tokens equal those of an engine without kvtier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import e2e
import pytest
from e2e import LONG, PREEMPT, ServerProcess, adds_up, tier_tokens

from kvtier.codec import ChunkHeader
from kvtier.keys import chunk_keys

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


server, llm = e2e.engine_fixtures("kvtier-e2e")


@pytest.fixture(scope="module")
def stored(llm: Any, baseline: dict[str, Any]) -> e2e.Result:
    """Round 1: nothing cached anywhere; every full prompt chunk gets stored."""
    first = e2e.generate(llm, LONG)
    assert first.tokens == baseline["LONG"]
    return first


def test_first_round_stores_full_chunks(stored: e2e.Result) -> None:
    for acct, prompt in zip(stored.kvtier, LONG, strict=True):
        assert acct["stored_chunks"] == len(prompt) // 256
        assert tier_tokens(acct, "recomputed") == len(prompt) and adds_up(acct, prompt)


def test_second_round_is_served_from_the_arena(llm: Any, stored: e2e.Result,
                                              baseline: dict[str, Any]) -> None:
    llm.reset_prefix_cache()
    second = e2e.generate(llm, LONG)
    assert second.tokens == baseline["LONG"]
    for acct, cached, prompt in zip(second.kvtier, second.cached, LONG, strict=True):
        full = len(prompt) // 256 * 256
        assert tier_tokens(acct, "arena") == full == cached
        assert adds_up(acct, prompt)
    # The 9000-token prompt spans three 4096-token steps (chunked prefill) both ways.
    assert tier_tokens(second.kvtier[0], "arena") == 8960
    assert e2e.metric(llm, "vllm:kvtier_loaded_tokens") >= sum(second.cached)


def test_tiny_arena_serves_from_disk(llm: Any, stored: e2e.Result, server: ServerProcess,
                                     baseline: dict[str, Any]) -> None:
    server.restart(arena_bytes=40 * (4096 + (1 << 20)))  # holds one prompt, not the round
    llm.reset_prefix_cache()
    third = e2e.one_by_one(llm, LONG)
    assert third.tokens == baseline["LONG"]
    for acct, prompt in zip(third.kvtier, LONG, strict=True):
        assert tier_tokens(acct, "disk") == len(prompt) // 256 * 256 and adds_up(acct, prompt)


def test_corrupt_chunk_on_disk_is_recomputed(llm: Any, stored: e2e.Result,
                                             server: ServerProcess,
                                             baseline: dict[str, Any]) -> None:
    server.restart()  # a fresh arena: the next load must read the files
    path = _chunk_file(server, LONG[0], index=10)
    data = bytearray(path.read_bytes())
    data[4096 + 12345] ^= 0x5A
    path.write_bytes(bytes(data))
    llm.reset_prefix_cache()
    result = e2e.generate(llm, LONG[:1])
    assert result.tokens == baseline["LONG"][:1]
    acct = result.kvtier[0]
    assert tier_tokens(acct, "disk") == 10 * 256  # chunks 0-9; from chunk 10 on: recompute
    assert acct["failed_load_tokens"] == 25 * 256
    assert adds_up(acct, LONG[0])


def test_killed_server_means_recompute_then_reconnect(llm: Any, stored: e2e.Result,
                                                      server: ServerProcess,
                                                      baseline: dict[str, Any]) -> None:
    server.kill()
    llm.reset_prefix_cache()
    down = e2e.generate(llm, LONG)
    assert down.tokens == baseline["LONG"]
    assert all(tier_tokens(a, "recomputed") == len(p) for a, p in zip(down.kvtier, LONG,
                                                                      strict=True))
    server.start()
    llm.reset_prefix_cache()
    back = e2e.one_by_one(llm, LONG)
    assert back.tokens == baseline["LONG"]
    assert tier_tokens(back.kvtier[1], "disk") == 11 * 256  # reconnected, disk index rebuilt


def test_preemption_under_a_full_device_cache(llm: Any, server: ServerProcess,
                                             baseline: dict[str, Any]) -> None:
    before = e2e.metric(llm, "vllm:num_preemptions")
    result = e2e.generate(llm, PREEMPT, max_tokens=200)
    assert e2e.metric(llm, "vllm:num_preemptions") > before
    assert result.tokens == baseline["PREEMPT"]
    for acct, prompt in zip(result.kvtier, PREEMPT, strict=True):
        assert adds_up(acct, prompt)
    assert server.stats()["leases"] == 0


def _chunk_file(server: ServerProcess, prompt: list[int], index: int) -> Path:
    """The disk file of chunk ``index`` of ``prompt``, found through the chunk headers."""
    files = {p.name.split(".")[0]: p for p in server.disk_path.rglob("*.kvc")}
    namespaces = {ChunkHeader.unpack(p.read_bytes()[:4096]).namespace_fp for p in files.values()}
    for fp in namespaces:
        keys = [k.hex() for k in chunk_keys(fp, prompt, 256)]
        if keys[0] in files:
            return files[keys[index]]
    raise AssertionError("the prompt's chunks are not on disk")
