"""Reading Mooncake JSONL and the kvtier access log; malformed lines and --skip-bad."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trace_helpers import mooncake_line, write_lines

from kvtier.trace.formats import Request, TraceFormatError, load_trace, write_mooncake

NS = "0123456789abcdef"


def log_line(keys: list[str], prompt: int, op: str = "lookup", chunk: int = 256) -> str:
    record = {"ts": 1700000000.5, "ns": NS, "op": op, "chunk_tokens": chunk,
              "prompt_tokens": prompt, "keys": keys, "tiers": [None] * len(keys)}
    return json.dumps(record)


def test_mooncake_lines_become_requests(tmp_path: Path) -> None:
    """timestamp 1500 ms -> 1.5 s; 1000 tokens in 512-token blocks -> ceil(1000/512) = 2 ids,
    the second partial, so only 1 full block."""
    path = write_lines(tmp_path / "t.jsonl", [mooncake_line(1500, 1000, [7, 8], output=30)])
    trace = load_trace(path)
    assert trace.format == "mooncake"
    assert trace.requests == [Request(1.5, 1000, 30, (7, 8), 512)]
    assert trace.requests[0].full_blocks == 1


def test_access_log_lines_become_requests(tmp_path: Path) -> None:
    """Keys are 16-hex digests -> 8 raw bytes; 600 prompt tokens in 256-token chunks have
    2 keyed chunks and an 88-token tail; non-lookup records are counted, not replayed."""
    lines = [log_line(["00000000000000aa", "00000000000000bb"], 600),
             log_line(["00000000000000aa"], 300, op="store")]
    trace = load_trace(write_lines(tmp_path / "log.jsonl", lines))
    assert trace.format == "kvtier"
    assert trace.block_tokens == 256
    (request,) = trace.requests
    assert request.blocks == (bytes.fromhex("00000000000000aa"), bytes.fromhex("00000000000000bb"))
    assert (request.ts_s, request.input_tokens, request.output_tokens) == (1700000000.5, 600, 0)
    assert trace.ignored == 1


BAD = [
    mooncake_line(0, 512, [1]),
    "not json at all",
    mooncake_line(5, 600, [1]),
    json.dumps({"timestamp": 9, "input_length": -1, "output_length": 0, "hash_ids": []}),
    mooncake_line(10, 1024, [1, 2]),
]


def test_malformed_line_names_its_line_number(tmp_path: Path) -> None:
    """Line 2 is not JSON: the error says file:2 and why."""
    path = write_lines(tmp_path / "bad.jsonl", BAD)
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        load_trace(path)


def test_skip_bad_keeps_the_good_lines(tmp_path: Path) -> None:
    """Lines 2 (not JSON), 3 (600 tokens need ceil(600/512) = 2 ids, has 1) and 4 (negative
    length) are skipped; lines 1 and 5 remain."""
    trace = load_trace(write_lines(tmp_path / "bad.jsonl", BAD), skip_bad=True)
    assert [r.ts_s for r in trace.requests] == [0.0, 0.01]
    assert [b.lineno for b in trace.skipped] == [2, 3, 4]
    assert "needs ceil(600/512) = 2" in trace.skipped[1].reason
    assert "'input_length' must be a non-negative integer" in trace.skipped[2].reason


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"timestamp": 0, "input_length": 5}', "cannot tell the format"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": true, "input_length": 1, "output_length": 0, "hash_ids": [1]}',
         "'timestamp' must be a non-negative number"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 0, "hash_ids": ["x"]}',
         "'hash_ids' must be a list of non-negative integers"),
        (log_line(["xyz"], 256), "'keys' must be a list of 16-hex"),
        (log_line(["00000000000000aa"], 100), "exceed prompt_tokens 100"),
        (json.dumps({"ts": 0, "ns": "nothex", "op": "lookup", "keys": []}), "'ns' must be 16 hex"),
    ],
)
def test_each_malformed_record_says_why(tmp_path: Path, line: str, reason: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [line])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: .*" + _escape(reason)):
        load_trace(path)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_missing_field_with_the_format_given(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", ['{"timestamp": 0, "input_length": 5}'])
    with pytest.raises(TraceFormatError, match="missing field 'output_length'"):
        load_trace(path, "mooncake")


def test_empty_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(write_lines(tmp_path / "t.jsonl", ["", "  "]))


def test_mooncake_round_trip(tmp_path: Path) -> None:
    """write_mooncake then load_trace gives back the same requests (ms timestamps)."""
    requests = [Request(0.25, 700, 3, (0, 1), 512), Request(1.0, 512, 0, (0,), 512)]
    path = tmp_path / "rt.jsonl"
    with open(path, "w") as out:
        write_mooncake(requests, out)
    assert load_trace(path).requests == requests
