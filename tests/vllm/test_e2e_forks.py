"""Agents that fork, through a real vLLM engine (CPU build, float32, greedy): the same long
prompt sent four times at once, its chain on disk only, is loaded into vLLM's KV cache once
and shared by the other three; every answer equals the one computed without any cache.
"""

from __future__ import annotations

from typing import Any

import e2e
import pytest
from e2e import ServerProcess, tier_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FORK = e2e.prompts([3000], seed=21)[0]
N = 4
CHUNKS = len(FORK) // 256


server, llm = e2e.engine_fixtures("kvtier-forks")


def test_four_forks_of_a_prefix_on_disk_load_it_once(llm: Any, server: ServerProcess) -> None:
    first = e2e.generate(llm, [FORK])  # nothing cached anywhere: computed and stored
    assert first.kvtier[0]["stored_chunks"] == CHUNKS
    server.restart()  # a new, empty arena: the chain is on disk only
    llm.reset_prefix_cache()
    loaded = e2e.metric(llm, "vllm:kvtier_loaded_tokens")
    waits = e2e.metric(llm, "vllm:kvtier_shared_load_waits")
    forks = e2e.generate(llm, [FORK] * N)
    assert forks.tokens == [first.tokens[0]] * N, "the answer computed without a cache"
    from_disk = [tier_tokens(acct, "disk") for acct in forks.kvtier]
    assert sorted(from_disk) == [0] * (N - 1) + [CHUNKS * 256], "one request loaded it"
    assert all(cached >= CHUNKS * 256 for cached in forks.cached), "the others shared it"
    assert e2e.metric(llm, "vllm:kvtier_loaded_tokens") - loaded == CHUNKS * 256
    assert e2e.metric(llm, "vllm:kvtier_shared_load_waits") - waits == N - 1


def test_without_sharing_each_fork_loads_the_prefix(demo_model: str,
                                                    server: ServerProcess) -> None:
    """The control: ``share_loads: false``, the same four at once each load it."""
    llm = e2e.make_llm(demo_model, server.socket_path, share_loads=False)
    try:
        first = e2e.generate(llm, [FORK])
        server.restart()
        llm.reset_prefix_cache()
        forks = e2e.generate(llm, [FORK] * N)
        assert forks.tokens == [first.tokens[0]] * N
        from_disk = [tier_tokens(acct, "disk") for acct in forks.kvtier]
        assert sum(from_disk) > CHUNKS * 256, f"more than one load: {from_disk}"
        assert e2e.metric(llm, "vllm:kvtier_shared_load_waits") == 0
    finally:
        e2e.close_llm(llm)
