"""Claude Code agent traces (kv-cache-tester's format) as one timeline of Requests.

``callanjfox/kv-cache-tester`` publishes real Claude Code sessions under ``traces/``, one JSON
file per conversation (Apache-2.0)::

    {"id": "trace_0001", "block_size": 64, "hash_id_scope": "local",
     "requests": [{"t": 0.0, "type": "n", "in": 71175, "out": 169, "hash_ids": [1, 2, ...],
                   "stop": "tool_use", ...},
                  {"t": 134.2, "type": "subagent", "agent_id": "agent_001",
                   "duration_ms": 126015, "requests": [{"t": 0.0, ...}, ...]}, ...]}

``t`` is seconds from the conversation's start; ``hash_ids`` name the full blocks of the
prompt, prefix-chained within the file (``local`` scope: the same number in two files is not
the same block). A ``subagent`` entry is a sub-agent the conversation forked: its ``t`` is when
it finished, it started ``duration_ms`` earlier, and its own requests' ``t`` count from that
start (sub-agents spawned together share a start; without ``duration_ms`` a sub-agent starts
with the latest request before it). ``stop`` is the answer's stop reason
(``tool_use``, ``end_turn``, or empty when the recording lost it).

Each conversation becomes a session (``trace_0001``; a sub-agent ``trace_0001/agent_001``),
its block ids are moved past those of the conversations before it, and it starts at its
``starts`` offset on the merged clock. Prompts keep their full blocks only: the source does
not name the partial last block, which no cache could hit anyway.

A file is input from elsewhere: anything malformed raises :class:`TraceFormatError` naming the
file and what was wrong; sizes and nesting are bounded.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.trace.formats import MAX_NAME, Request, TraceFormatError

MAX_FILE_BYTES = 64 << 20
MAX_DEPTH = 4
"""Sub-agents nested deeper than this are refused (the published traces nest one level)."""
MAX_BLOCK_ID = 1 << 40


def agent_files(paths: Iterable[str | Path]) -> list[Path]:
    """The ``*.json`` files of ``paths`` (files, or folders read one level deep), sorted."""
    found: list[Path] = []
    for p in map(Path, paths):
        found.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    if not found:
        raise TraceFormatError("no agent trace files (*.json) found")
    return found


def load_agentic(paths: Sequence[str | Path], stagger_s: float = 0.0,
                 seed: int = 0) -> list[Request]:
    """Every conversation of ``paths`` on one clock, in arrival order: conversation ``k``
    starts at the sum of ``k`` exponential gaps of mean ``stagger_s`` (0: all at once),
    drawn from ``seed``."""
    if not math.isfinite(stagger_s) or stagger_s < 0:
        raise TraceFormatError(f"stagger_s must be a non-negative number, got {stagger_s!r}")
    rng = random.Random(seed)
    out: list[Request] = []
    start, offset = 0.0, 0
    for path in agent_files(paths):
        requests, top = read_conversation(path, start, offset)
        out.extend(requests)
        offset = top + 1
        start += rng.expovariate(1.0 / stagger_s) if stagger_s else 0.0
    out.sort(key=lambda r: r.ts_s)  # stable: a conversation's order holds at equal times
    return out


def read_conversation(path: Path, start_s: float = 0.0,
                      offset: int = 0) -> tuple[list[Request], int]:
    """One conversation's requests (sub-agents included) at ``start_s`` with block ids
    moved by ``offset``; and the highest block id used (``offset - 1`` if none)."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise TraceFormatError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({exc})") from exc
    try:
        return _Conversation(doc, offset).read(start_s)
    except _Bad as exc:
        raise TraceFormatError(f"{path}: {exc}") from exc


class _Bad(Exception):
    """Why a file was refused."""


class _Conversation:
    def __init__(self, doc: object, offset: int) -> None:
        if not isinstance(doc, dict):
            raise _Bad("expected a JSON object with 'id', 'block_size' and 'requests'")
        self.doc = doc
        self.name = _name(doc.get("id"), "id")
        block = doc.get("block_size")
        if isinstance(block, bool) or not isinstance(block, int) or not 0 < block <= 1 << 20:
            raise _Bad(f"'block_size' must be a positive integer, got {block!r:.40}")
        self.block_tokens = block
        self.offset = offset
        self.top = offset - 1
        self.out: list[Request] = []

    def read(self, start_s: float) -> tuple[list[Request], int]:
        self._entries(self.doc.get("requests"), start_s, self.name, 0)
        return self.out, self.top

    def _entries(self, entries: object, start_s: float, session: str, depth: int) -> None:
        if not isinstance(entries, list):
            raise _Bad(f"session {session}: 'requests' must be a list")
        spawned = start_s  # the latest request of this session so far
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise _Bad(f"session {session}, entry {i}: expected an object")
            where = f"session {session}, entry {i}"
            if entry.get("type") == "subagent":
                if depth >= MAX_DEPTH:
                    raise _Bad(f"{where}: sub-agents nested deeper than {MAX_DEPTH}")
                agent = _name(entry.get("agent_id"), f"{where}: 'agent_id'")
                done = start_s + _seconds(entry, "t", where)
                begun = spawned if entry.get("duration_ms") is None else (
                    done - _seconds(entry, "duration_ms", where) / 1000.0)
                self._entries(entry.get("requests"), max(start_s, begun),
                              f"{session}/{agent}", depth + 1)
            else:
                request = self._request(entry, start_s, session, where)
                spawned = request.ts_s
                self.out.append(request)

    def _request(self, r: dict[str, Any], start_s: float, session: str, where: str) -> Request:
        tokens = _count(r, "in", where)
        ids = r.get("hash_ids")
        if not isinstance(ids, list) or not all(
                type(i) is int and 0 <= i < MAX_BLOCK_ID for i in ids):
            raise _Bad(f"{where}: 'hash_ids' must be a list of integers in [0, 2^40)")
        if len(ids) > -(-tokens // self.block_tokens):
            raise _Bad(f"{where}: {len(ids)} hash_ids exceed 'in' {tokens} tokens in blocks "
                       f"of {self.block_tokens}")
        if ids:
            self.top = max(self.top, self.offset + max(ids))
        stop = r.get("stop")
        if stop is not None and (not isinstance(stop, str) or len(stop) > MAX_NAME):
            raise _Bad(f"{where}: 'stop' must be a string of at most {MAX_NAME} characters")
        return Request(
            ts_s=round(start_s + _seconds(r, "t", where), 3),
            input_tokens=len(ids) * self.block_tokens,
            output_tokens=_count(r, "out", where),
            blocks=tuple(self.offset + i for i in ids),
            block_tokens=self.block_tokens,
            session=session,
            stop_reason=stop or None,
        )


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME // 2 or "/" in value:
        raise _Bad(f"{what} must be a non-empty string of at most {MAX_NAME // 2} characters "
                   f"without '/', got {value!r:.40}")
    return value


def _seconds(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and 0 <= value <= 1e10):
        raise _Bad(f"{where}: {key!r} must be a non-negative number, got {value!r:.40}")
    return float(value)


def _count(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if type(value) is not int or not 0 <= value <= 1 << 32:
        raise _Bad(f"{where}: {key!r} must be a non-negative integer, got {value!r:.40}")
    return value
