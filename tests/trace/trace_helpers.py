"""Tiny builders for hand-made traces and a way to run ``kvtier trace`` in-process."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from kvtier.trace.cli import register
from kvtier.trace.formats import Request

BT = 512


def req(blocks: Sequence[int], ts: float = 0.0, tokens: int | None = None, bt: int = BT) -> Request:
    """A request whose blocks are all full unless ``tokens`` says otherwise."""
    n = len(blocks) * bt if tokens is None else tokens
    return Request(ts, n, 0, tuple(blocks), bt)


def trace_a() -> list[Request]:
    """The hand-worked trace of the tests: ids are prefix-chained (1 is the common root).

    r1 [1, 2, 3] at 0 s;  r2 [1, 2, 4] at 10 s;  r3 [1, 5] at 15 s;  r4 [1, 2, 3, 6] at 40 s
    """
    return [req([1, 2, 3], 0), req([1, 2, 4], 10), req([1, 5], 15), req([1, 2, 3, 6], 40)]


def mooncake_line(ts_ms: int, input_length: int, ids: Sequence[int], output: int = 1) -> str:
    record = {"timestamp": ts_ms, "input_length": input_length, "output_length": output,
              "hash_ids": list(ids)}
    return json.dumps(record)


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_trace_a(path: Path) -> Path:
    lines = [mooncake_line(int(r.ts_s * 1000), r.input_tokens, r.blocks) for r in trace_a()]  # type: ignore[arg-type]
    return write_lines(path, lines)


def run_trace(*argv: str) -> int:
    """``kvtier trace ARGV...`` through the same register() the top-level CLI calls."""
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", *argv])
    return int(args.func(args))
