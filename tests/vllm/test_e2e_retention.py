"""The router's session retention through a real vLLM engine (CPU build): the retention for
how the engine ended a request (``finish``) lands on its chunks, within its tenant's quota.

The node server runs in this process (the engine and its connector in vLLM's own), so the
test reads the store's priorities directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import e2e
import pytest
from store_helpers import sample

from kvtier.config import ServerConfig
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.server import EmbeddedServer, NodeServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SLOT = 4096 + (1 << 20)
PROMPT = e2e.prompts([3 * 256 + 10], seed=36)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeServer]:
    root = tmp_path_factory.mktemp("kvtier-retention")
    config = ServerConfig.from_dict({
        "socket_path": str(root / "kvtier.sock"),
        "arena": {"size_bytes": 32 * SLOT, "slot_bytes": SLOT, "free_target": 0.0},
        "retention_quotas": {"tenants": {"alice": {"arena": 2 * SLOT},
                                         "bob": {"arena": 8 * SLOT}},
                             "others": {"arena": 0}}})
    node = EmbeddedServer(config).start()
    yield node
    node.stop(drain_s=5)


@pytest.fixture(scope="module")
def llm(demo_model: str, server: NodeServer) -> Iterator[Any]:
    engine = e2e.make_llm(demo_model, server.socket_path)
    yield engine
    e2e.close_llm(engine)


def priorities(server: NodeServer) -> list[int]:
    assert server.store is not None
    return sorted(e.priority for e in server.store.entries.values())


def test_the_finish_retention_for_how_it_ended_lands_within_the_quota(
        llm: Any, server: NodeServer) -> None:
    """``max_tokens`` ends it (``length``): its entry, not ``stop``'s, is set on the
    prompt's 3 chunks when it finishes; Alice's quota of 2 slots pins the head 2 only. A
    tenant without a quota of its own (``others``: 0) pins none."""
    finish = {"stop": {"priority": 90, "duration_s": 300},
              "length": {"priority": 60, "duration_s": 300}}
    first = e2e.generate(llm, [PROMPT], max_tokens=4, finish=finish, tenant="alice")
    assert first.kvtier[0]["stored_chunks"] == 3
    assert priorities(server) == [DEFAULT_PRIORITY, 60, 60]
    assert server.store is not None
    assert server.store.quotas.used("alice", "arena") == 2 * SLOT
    other = e2e.prompts([2 * 256 + 3], seed=37)[0]
    e2e.generate(llm, [other], max_tokens=4, finish=finish, tenant="mallory")
    assert priorities(server) == [DEFAULT_PRIORITY] * 3 + [60, 60]
    assert sample(server.store, "kvtier_retention_quota_clipped_chunks_total",
                  tier="arena") >= 1 + 2  # alice's third chunk, mallory's two
    server.store.check_integrity()


def test_an_answer_with_the_tool_call_token_keeps_the_tool_calls_retention(
        llm: Any, server: NodeServer) -> None:
    """``finish.tool_call_tokens`` through the real engine: the connector reads the answer's
    token ids when vLLM says it stopped. Marked with a token the answer holds, the prompt
    takes ``tool_calls``'s priority; marked with one it does not hold, ``length``'s (what
    ``max_tokens`` ends in). The answers equal the unmarked run's."""
    prompt = e2e.prompts([2 * 256 + 5], seed=38)[0]
    plain = e2e.generate(llm, [prompt], max_tokens=4)
    answer = plain.tokens[0]
    absent = next(t for t in range(1000, 2000) if t not in answer)
    assert server.store is not None
    for marker, want in ((answer[2], 85), (absent, 45)):
        finish = {"length": {"priority": 45, "duration_s": 300},
                  "tool_calls": {"priority": 85, "duration_s": 300},
                  "tool_call_tokens": [marker]}
        marked = e2e.generate(llm, [prompt], max_tokens=4, finish=finish, tenant="bob")
        assert marked.tokens == plain.tokens
        keys = [k for k, e in server.store.entries.items() if e.priority in (45, 85)]
        assert len(keys) == 2 and {server.store.entries[k].priority for k in keys} == {want}
        release = e2e.generate(llm, [prompt], max_tokens=4, release=True, tenant="bob")
        assert release.tokens == plain.tokens
    server.store.check_integrity()
