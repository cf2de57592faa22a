"""Two vLLM engines on one kvtier server (vLLM CPU build, float32, greedy).

Engine A stores a round; the server restarts (its arena is gone, its disk stays); engine B,
started only then, is served from disk. Then both run against the live arena: B hits what A
stored a moment before. Last, B aborts a request while its load is still in flight, and
keeps serving correctly with no lease left behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import e2e
import pytest
from e2e import ABORTED, SHARED_1, SHARED_2, ServerProcess, adds_up, tier_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HOLD_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("kvtier-shared")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engine_a(demo_model: str, server: ServerProcess, baseline: dict[str, Any]
             ) -> Iterator[Any]:
    llm = e2e.make_llm(demo_model, server.socket_path)
    stored = e2e.generate(llm, SHARED_1)
    assert stored.tokens == baseline["SHARED_1"]
    yield llm
    e2e.close_llm(llm)


@pytest.fixture(scope="module")
def engine_b(demo_model: str, server: ServerProcess, engine_a: Any) -> Iterator[Any]:
    """Started after A stored SHARED_1 and after the server lost its arena."""
    server.restart()
    # B's loads are held back on its scheduler for a while, so a test can abort one.
    llm = e2e.make_llm(demo_model, server.socket_path, faults={"hold_loads_s": HOLD_S})
    yield llm
    e2e.close_llm(llm)


def test_a_later_engine_reuses_the_disk_tier(engine_b: Any, baseline: dict[str, Any]) -> None:
    result = e2e.one_by_one(engine_b, SHARED_1)
    assert result.tokens == baseline["SHARED_1"]
    for acct, prompt in zip(result.kvtier, SHARED_1, strict=True):
        assert tier_tokens(acct, "disk") == len(prompt) // 256 * 256 and adds_up(acct, prompt)


def test_b_hits_what_a_stored_in_the_arena(engine_a: Any, engine_b: Any,
                                           baseline: dict[str, Any]) -> None:
    stored = e2e.generate(engine_a, SHARED_2)
    assert stored.tokens == baseline["SHARED_2"]
    result = e2e.generate(engine_b, SHARED_2)
    assert result.tokens == baseline["SHARED_2"]
    for acct, prompt in zip(result.kvtier, SHARED_2, strict=True):
        assert tier_tokens(acct, "arena") == len(prompt) // 256 * 256 and adds_up(acct, prompt)


def test_abort_while_the_load_is_in_flight(engine_a: Any, engine_b: Any, server: ServerProcess,
                                           baseline: dict[str, Any]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    assert e2e.generate(engine_a, ABORTED).tokens == baseline["ABORTED"]
    engine = engine_b.llm_engine
    engine.add_request("abort-me", TokensPrompt(prompt_token_ids=ABORTED[0]),
                       SamplingParams(max_tokens=8, temperature=0.0))
    time.sleep(HOLD_S / 4)  # admitted; its load is held on the scheduler side
    engine.abort_request(["abort-me"])
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()
    assert not engine.has_unfinished_requests()
    assert _eventually(lambda: server.stats()["leases"] == 0)
    after = e2e.generate(engine_b, ABORTED)  # the engine goes on, loads again, correctly
    assert after.tokens == baseline["ABORTED"]
    assert tier_tokens(after.kvtier[0], "arena") == len(ABORTED[0]) // 256 * 256
    # The engine's stats (pulled by the request above) show the abort hit a held load.
    assert e2e.metric(engine_b, "vllm:kvtier_cancelled_loads") == 1
    assert _eventually(lambda: server.stats()["leases"] == 0)


def _eventually(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False
