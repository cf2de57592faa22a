"""A request's retention hint (kv_transfer_params.kvtier.retention): parsed, bounded, and
resolved per chunk as TensorRT-LLM's token ranges are."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.hints import (
    MAX_RANGES,
    RetentionHint,
    TokenRange,
    chunk_retentions,
    parse_retention,
    runs,
)
from kvtier.policies import MAX_RETAIN_S


def test_ranges_the_whole_prompt_and_decode_resolve_per_chunk() -> None:
    hint = parse_retention({
        "priority": 50, "duration_s": 5,
        "ranges": [{"start": 0, "end": 300, "priority": 90, "duration_s": 60},
                   {"start": 200, "priority": 95}],
        "decode_priority": 10, "decode_duration_s": 2})
    got = chunk_retentions(hint, 5, 100, 400, (35, None))
    assert got == [(90, 60.0), (90, 60.0), (95, None), (95, None), (10, 2.0)]
    assert runs(got) == [(0, 2, (90, 60.0)), (2, 4, (95, None)), (4, 5, (10, 2.0))]
    assert runs(got, 1, 3) == [(1, 2, (90, 60.0)), (2, 3, (95, None))]
    assert runs(got, 3, 3) == []
    only_prompt = parse_retention({"priority": 70})
    assert chunk_retentions(only_prompt, 2, 100, 200, (35, None)) == [(70, None)] * 2
    assert chunk_retentions(None, 2, 100, 200, (60, None)) == [(60, None)] * 2


@pytest.mark.parametrize(("raw", "message"), [
    ({"priority": 101}, r"retention.priority must be in \[0, 100\], got 101"),
    ({"priority": -1}, r"retention.priority must be in \[0, 100\], got -1"),
    ({"priority": True}, r"retention.priority"),
    ({"priority": 80, "duration_s": 0}, r"retention.duration_s must be in \(0, 86400\], got 0"),
    ({"priority": 80, "duration_s": -3}, r"retention.duration_s must be in \(0, 86400\]"),
    ({"priority": 80, "duration_s": math.nan}, r"retention.duration_s"),
    ({"priority": 80, "duration_s": math.inf}, r"duration_s must be in \(0, 86400\], got inf"),
    ({"priority": 80, "duration_s": 1e30}, r"retention.duration_s must be in \(0, 86400\]"),
    ({"priority": 80, "duration_s": "30"}, r"retention.duration_s"),
    ({"duration_s": 30}, r"duration_s needs a priority"),
    ({"decode_duration_s": 3}, r"decode_duration_s needs a decode_priority"),
    ({"ranges": [{"start": 10, "end": 10, "priority": 80}]}, r"end must be greater than start"),
    ({"ranges": [{"start": -1, "priority": 80}]}, r"ranges\[0\].start"),
    ({"ranges": [{"start": 0}]}, r"ranges\[0\].*priority"),
    ({"ranges": [{"priority": 80}] * (MAX_RANGES + 1)}, r"retention.ranges: .*<= 8"),
    ({"ranges": "all"}, r"retention.ranges"),
    ({"pin": True}, r"pin"),
    ("high", r"retention"),
])
def test_bad_hints_are_refused_naming_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_retention(raw)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3))
RAW_RANGE = st.dictionaries(st.sampled_from(["start", "end", "priority", "duration_s", "x"]),
                            VALUES, max_size=4)
RAW = st.dictionaries(
    st.sampled_from(["priority", "duration_s", "ranges", "decode_priority",
                     "decode_duration_s"]),
    st.one_of(VALUES, st.lists(RAW_RANGE, max_size=3)), max_size=5)


@settings(max_examples=400, deadline=None)
@given(raw=RAW, prompt=st.integers(0, 2000))
def test_any_hint_is_refused_clearly_or_resolves_to_bounded_retentions(
        raw: dict[str, Any], prompt: int) -> None:
    """Hostile values are not filtered out: whatever a client sends either parses into
    retentions a store accepts, or is a ConfigError naming where."""
    try:
        hint = parse_retention(raw)
    except ConfigError as exc:
        assert str(exc).startswith("kv_transfer_params.kvtier.retention")
        return
    for priority, duration in chunk_retentions(hint, 8, 256, prompt, (35, None)):
        assert 0 <= priority <= 100
        assert duration is None or 0 < duration <= MAX_RETAIN_S


def test_a_range_overlapping_a_chunk_partly_still_counts() -> None:
    hint = RetentionHint(ranges=(TokenRange(priority=90, start=250, end=260),))
    assert chunk_retentions(hint, 3, 256, 768, (35, None)) == [(90, None), (90, None),
                                                               (35, None)]


def test_the_most_ranges_cost_at_most_17_store_calls() -> None:
    """Each run of equal retention is a blocking round trip in vLLM's scheduler loop: the
    worst hint allowed (every range apart from the others) makes 2 * 8 + 1 runs."""
    assert MAX_RANGES == 8
    ranges = [{"start": 2 * i * 16 + 16, "end": 2 * i * 16 + 32, "priority": 90}
              for i in range(MAX_RANGES)]
    hint = parse_retention({"priority": 50, "ranges": ranges})
    assert hint is not None
    retentions = chunk_retentions(hint, 40, 16, 40 * 16, (35, None))
    assert len(runs(retentions)) == 2 * MAX_RANGES + 1
    with pytest.raises(ConfigError, match=r"retention.ranges: .*<= 8"):
        parse_retention({"ranges": [*ranges, {"start": 0, "end": 1, "priority": 1}]})


def test_a_finish_retention_per_reason_is_parsed_and_checked() -> None:
    from kvtier.hints import FinishRetention, Retain
    from kvtier.vllm.config import RequestOptions

    options = RequestOptions.from_params({"kvtier": {
        "finish": {"stop": {"priority": 80, "duration_s": 120}}, "tenant": "alice"}})
    assert options.finish == FinishRetention(stop=Retain(80, 120.0))
    assert options.tenant == "alice"
    assert options.finish.of("stop") == Retain(80, 120.0)
    assert options.finish.of("length") is None and options.finish.of("__class__") is None
    for bad in ({"finish": {"tool_calls": {"priority": 80}}},  # no marker: never told apart
                {"finish": {"tool_calls": {"priority": 80}, "tool_call_tokens": []}},
                {"finish": {"tool_call_tokens": [-1]}},
                {"finish": {"tool_call_tokens": [1 << 31]}},
                {"finish": {"tool_call_tokens": list(range(17))}},
                {"finish": {"tool_call_tokens": ["<tool_call>"]}},
                {"finish": {"stop": {"priority": 101}}},
                {"finish": {"stop": {"priority": 80, "duration_s": 0}}},
                {"tenant": ""}, {"tenant": "x" * 65}):
        assert RequestOptions.from_params({"kvtier": bad}) == RequestOptions(), bad


def test_an_answer_that_holds_a_tool_call_token_ended_in_tool_calls() -> None:
    """With ``tool_call_tokens`` the engine tells a tool call from an end of turn: an answer
    whose generated tokens hold a marker takes ``tool_calls``'s retention however it ended
    (a stop string ends it as an abort in vLLM 0.32), one without takes its reason's; no
    marker list, no tool calls."""
    from kvtier.hints import FinishRetention, Retain
    from kvtier.vllm.config import RequestOptions

    options = RequestOptions.from_params({"kvtier": {"finish": {
        "stop": {"priority": 40, "duration_s": 600},
        "tool_calls": {"priority": 80, "duration_s": 20},
        "tool_call_tokens": [151657, 7]}}})
    finish = options.finish
    assert finish is not None and finish.tool_call_tokens == (151657, 7)
    assert finish.of("stop", [3, 4, 151657, 5]) == Retain(80, 20.0)
    assert finish.of("length", iter([7])) == Retain(80, 20.0)
    assert finish.of("stop", [3, 4, 5]) == Retain(40, 600.0)
    assert finish.of("length", [3]) is None
    assert finish.of("abort", [7]) == Retain(80, 20.0)
    assert finish.of("abort", [3]) is None
    assert finish.of(None, [7]) is None
    assert FinishRetention(stop=Retain(40)).of("stop", [151657]) == Retain(40)


@pytest.mark.parametrize("ids", [[-1], [1 << 31], list(range(17)), [True], [1.0], "7"])
def test_bad_tool_call_tokens_are_refused_naming_what_is_allowed(ids: object) -> None:
    from kvtier.config import parse
    from kvtier.hints import FinishRetention

    with pytest.raises(ConfigError, match="tool_call_tokens"):
        parse(FinishRetention, {"tool_call_tokens": ids}, "finish")
