"""A request's decode retention (``decode_priority``, ``decode_duration_s``) reaches the chunks
of the tokens it generates: they are stored (the next turn starts with them) and kept at that
priority, while its prompt chunks keep theirs; without one, generated tokens are not stored.

Real scheduler and worker sides and a real node server, no engine (tests/vllm/rig.py); the
rig generates tokens one step each, as vLLM's decode does.
"""

from __future__ import annotations

from typing import Any

import pytest
from rig import BLOCK, CHUNK

from kvtier.hints import FinishRetention, Retain, RetentionHint
from kvtier.keys import chunk_keys
from kvtier.store import TieredStore

PROMPT = list(range(100, 200))  # 100 tokens: chunks 0-2 are the prompt's
ANSWER = list(range(600, 660))  # 60 generated: chunk 3 (tokens 96-127) straddles, 4 is theirs
TURN = PROMPT + ANSWER


def retention_of(store: TieredStore, keys: list[Any]) -> list[tuple[int, float | None] | None]:
    """Each key's priority and seconds left in the arena (``None``: not held)."""
    now = store.clock()
    out: list[tuple[int, float | None] | None] = []
    for key in keys:
        held = store.index.policy.retention(key)
        out.append(None if held is None else (held[0], None if held[1] is None
                                              else held[1] - now))
    return out


def test_generated_chunks_are_stored_at_the_decode_retention(make_server: Any,
                                                             engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    hint = RetentionHint(priority=60, decode_priority=90, decode_duration_s=30.0)
    req = engine.add(PROMPT, retention=hint)
    engine.run(req)
    engine.decode(req, ANSWER)
    assert engine.blocks_match_recompute(req, len(TURN) // BLOCK)
    params = engine.finish(req)
    assert params["stored_chunks"] == 5
    store = server.store
    assert store is not None and store.flush(5)
    keys = chunk_keys(engine.sched.ns.fingerprint, TURN, CHUNK)
    held = retention_of(store, keys)
    assert [h[0] if h else None for h in held] == [60, 60, 60, 60, 90]
    assert held[4] is not None and held[4][1] == pytest.approx(30.0, abs=2.0)
    # the next turn starts with the answer: served from kvtier, chunk 4 included
    nxt = engine.add(TURN + list(range(900, 940)))
    assert engine.hit(nxt) == 5 * CHUNK
    engine.run(nxt)
    assert engine.blocks_match_recompute(nxt, 5 * CHUNK // BLOCK)
    engine.finish(nxt)
    store.check_integrity()


def test_without_a_decode_retention_generated_tokens_are_not_stored(
        make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    req = engine.add(PROMPT, retention=RetentionHint(priority=60))
    engine.run(req)
    engine.decode(req, ANSWER)
    assert engine.finish(req)["stored_chunks"] == 3
    assert server.store is not None
    keys = chunk_keys(engine.sched.ns.fingerprint, TURN, CHUNK)
    assert server.store.lookup(keys) == ["arena"] * 3


def test_a_low_decode_priority_keeps_the_prompt_and_lets_the_answer_go_first(
        make_server: Any, engines: Any) -> None:
    """An agent's scratch output: prompt at 80, generated chunks at 10, evicted first."""
    server = make_server(slots=16)
    engine = engines(server)
    req = engine.add(PROMPT, retention=RetentionHint(priority=80, decode_priority=10))
    engine.run(req)
    engine.decode(req, ANSWER)
    engine.finish(req)
    store = server.store
    assert store is not None
    keys = chunk_keys(engine.sched.ns.fingerprint, TURN, CHUNK)
    assert [h[0] if h else None for h in retention_of(store, keys)] == [80, 80, 80, 80, 10]
    assert store.index.policy.order()[0] == keys[4], "the answer's chunk leaves first"


def test_the_next_turns_release_drops_the_answer_too(make_server: Any, engines: Any) -> None:
    server = make_server(slots=16)
    engine = engines(server)
    req = engine.add(PROMPT, retention=RetentionHint(priority=70, decode_priority=70))
    engine.run(req)
    engine.decode(req, ANSWER)
    engine.finish(req)
    done = engine.add(TURN + list(range(900, 940)), release=True)
    engine.run(done)
    engine.finish(done)
    store = server.store
    assert store is not None
    keys = chunk_keys(engine.sched.ns.fingerprint, TURN, CHUNK)
    assert [h[0] if h else None for h in retention_of(store, keys)] == [0] * 5


@pytest.mark.parametrize("marked", [True, False])
def test_an_answer_with_a_tool_call_token_takes_the_tool_calls_retention_at_finish(
        make_server: Any, engines: Any, marked: bool) -> None:
    """``finish.tool_call_tokens``: the scheduler reads the answer's tokens when vLLM says
    it stopped; one holding a marker gets ``tool_calls``'s retention on its prompt, one
    without gets ``stop``'s."""
    server = make_server(slots=16)
    engine = engines(server)
    finish = FinishRetention(stop=Retain(40, 600.0), tool_calls=Retain(80, 20.0),
                             tool_call_tokens=(ANSWER[7] if marked else 5,))
    req = engine.add(PROMPT, finish=finish)
    engine.run(req)
    engine.decode(req, ANSWER[:10])
    assert engine.finish(req, "stop")["stored_chunks"] == 3
    store = server.store
    assert store is not None and store.flush(5)
    held = retention_of(store, chunk_keys(engine.sched.ns.fingerprint, PROMPT, CHUNK)[:3])
    want = (80, 20.0) if marked else (40, 600.0)
    assert [h[0] if h else None for h in held] == [want[0]] * 3
    assert all(h is not None and h[1] == pytest.approx(want[1], abs=2.0) for h in held)
