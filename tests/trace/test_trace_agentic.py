"""Claude Code agent traces (kv-cache-tester's format) read into one timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from trace_helpers import run_trace

from kvtier.trace.agentic import load_agentic, read_conversation
from kvtier.trace.formats import TraceFormatError, load_trace


def _turn(t: float, ids: list[int], stop: str = "tool_use", extra: int = 10) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": len(ids) * 64 + extra, "out": 5, "hash_ids": ids,
            "stop": stop}


def conversation(name: str = "trace_0001") -> dict[str, Any]:
    """A parent that forks two sub-agents together after its first answer (they finish at
    40 s and 50 s, having run 30 s and 40 s: both started at 10 s), then ends its turn."""
    return {"id": name, "block_size": 64, "hash_id_scope": "local", "requests": [
        _turn(0.0, [1, 2]),
        {"t": 40.0, "type": "subagent", "agent_id": "agent_001", "duration_ms": 30000,
         "requests": [_turn(0.0, [7, 8]), _turn(12.0, [7, 8, 9], "end_turn")]},
        {"t": 50.0, "type": "subagent", "agent_id": "agent_002", "duration_ms": 40000,
         "requests": [_turn(0.0, [7, 10], "")]},
        _turn(55.0, [1, 2, 3], "end_turn"),
    ]}


def write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_a_conversation_and_its_sub_agents_become_sessions_on_one_clock(tmp_path: Path) -> None:
    reqs, top = read_conversation(write(tmp_path / "a.json", conversation()), 100.0, 1000)
    assert [(r.ts_s, r.session, r.blocks, r.stop_reason) for r in reqs] == [
        (100.0, "trace_0001", (1001, 1002), "tool_use"),
        (110.0, "trace_0001/agent_001", (1007, 1008), "tool_use"),
        (122.0, "trace_0001/agent_001", (1007, 1008, 1009), "end_turn"),
        (110.0, "trace_0001/agent_002", (1007, 1010), None),  # a lost stop reason
        (155.0, "trace_0001", (1001, 1002, 1003), "end_turn")]
    assert top == 1010
    assert [r.input_tokens for r in reqs] == [128, 128, 192, 128, 192]  # full blocks only
    assert all(r.block_tokens == 64 for r in reqs)


def test_conversations_keep_their_own_ids_and_can_start_staggered(tmp_path: Path) -> None:
    write(tmp_path / "a.json", conversation("a"))
    write(tmp_path / "b.json", conversation("b"))
    together = load_agentic([tmp_path])
    assert [r.ts_s for r in together] == sorted(r.ts_s for r in together)
    a = {b for r in together if r.session and r.session.startswith("a") for b in r.blocks}
    b = {b for r in together if r.session and r.session.startswith("b") for b in r.blocks}
    assert min(b) == max(a) + 2  # b's ids (from 1) moved past a's highest (10)
    assert {r.ts_s for r in together if r.session == "b"} == {0.0, 55.0}
    staggered = load_agentic([tmp_path], stagger_s=600.0, seed=3)
    assert staggered == load_agentic([tmp_path], stagger_s=600.0, seed=3)
    start_b = min(r.ts_s for r in staggered if r.session == "b")
    assert start_b > 0 and start_b != min(
        r.ts_s for r in load_agentic([tmp_path], stagger_s=600.0, seed=4) if r.session == "b")


def test_a_sub_agent_without_a_duration_starts_with_the_request_before_it(
        tmp_path: Path) -> None:
    doc = conversation()
    del doc["requests"][1]["duration_ms"]
    reqs, _top = read_conversation(write(tmp_path / "a.json", doc))
    assert [r.ts_s for r in reqs if r.session == "trace_0001/agent_001"] == [0.0, 12.0]


def _nested(depth: int) -> dict[str, Any]:
    entry: dict[str, Any] = _turn(0.0, [1])
    for k in range(depth):
        entry = {"t": 1.0, "type": "subagent", "agent_id": f"a{k}", "duration_ms": 1,
                 "requests": [entry]}
    return entry


@pytest.mark.parametrize(("change", "reason"), [
    (lambda d: d["requests"][0].update(hash_ids=[1, 2, 3, 4]), "exceed 'in'"),
    (lambda d: d["requests"][0].update(hash_ids=[1, -2]), "'hash_ids' must be a list"),
    (lambda d: d["requests"][0].update(hash_ids=[1, 2 ** 41]), "'hash_ids' must be a list"),
    (lambda d: d["requests"][0].update(hash_ids=[True]), "'hash_ids' must be a list"),
    (lambda d: d["requests"][0].update(t=float("nan")), "'t' must be a non-negative"),
    (lambda d: d["requests"][0].update(t=-1), "'t' must be a non-negative"),
    (lambda d: d["requests"][0].update({"in": "many"}), "'in' must be a non-negative"),
    (lambda d: d["requests"][0].update(stop=["x"]), "'stop' must be a string"),
    (lambda d: d["requests"][1].update(agent_id="../x"), "'agent_id' must be"),
    (lambda d: d["requests"][1].update(duration_ms="long"), "'duration_ms' must be"),
    (lambda d: d["requests"][1].update(requests={}), "'requests' must be a list"),
    (lambda d: d["requests"].append(7), "expected an object"),
    (lambda d: d.update(block_size=0), "'block_size' must be a positive"),
    (lambda d: d.update(id=""), "id must be a non-empty string"),
    (lambda d: d["requests"].append(_nested(6)), "nested deeper than 4"),
])
def test_malformed_files_are_refused_with_the_file_and_the_reason(
        tmp_path: Path, change: Any, reason: str) -> None:
    doc = conversation()
    change(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc, allow_nan=True))
    with pytest.raises(TraceFormatError, match=reason) as info:
        load_agentic([path])
    assert str(path) in str(info.value)


def test_not_json_or_no_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        load_agentic([tmp_path])
    with pytest.raises(TraceFormatError, match="no agent trace files"):
        load_agentic([tmp_path / "empty"] if (tmp_path / "empty").mkdir() is None else [])
    with pytest.raises(TraceFormatError, match="stagger_s"):
        load_agentic([tmp_path], stagger_s=-1.0)


def test_the_agents_command_writes_a_trace_simulate_reads(tmp_path: Path) -> None:
    write(tmp_path / "a.json", conversation())
    out = tmp_path / "agents.jsonl"
    assert run_trace("agents", str(tmp_path / "a.json"), "-o", str(out)) == 0
    trace = load_trace(out, block_tokens=64)
    assert [(r.session, r.stop_reason) for r in trace.requests] == [
        ("trace_0001", "tool_use"), ("trace_0001/agent_001", "tool_use"),
        ("trace_0001/agent_002", None), ("trace_0001/agent_001", "end_turn"),
        ("trace_0001", "end_turn")]
    result = tmp_path / "r.json"
    assert run_trace("simulate", str(out), "--block-tokens", "64", "--tier", "host=inf",
                     "--hints", "session", "--json", str(result)) == 0
    # 2 of parent's 3 blocks at 55 s, agent_001's 2 of 3, agent_002's 7: 5 hits of 12
    assert json.loads(result.read_text())["block_hit_ratio"] == pytest.approx(5 / 12)
