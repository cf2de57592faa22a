"""Trace readers: Mooncake's published JSONL and kvtier's own access log, one Request each.

Both formats are one JSON object per line. Every request becomes a :class:`Request` whose
``blocks`` are prefix-chained block ids: equal ids mean an equal prefix, so the ids can be used
as cache keys directly (ints from Mooncake, 8 raw bytes from the 16-hex access-log digests).

A malformed line raises :class:`TraceFormatError` naming the file, the line number and the
reason; with ``skip_bad`` the line is skipped and reported through ``on_bad`` instead.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO, cast

from kvtier.errors import KvtierError
from kvtier.policies.retention import DEFAULT_PRIORITY, Retention

BlockId = int | bytes
Format = Literal["mooncake", "kvtier"]
FORMATS: tuple[str, ...] = ("auto", "mooncake", "kvtier")
MOONCAKE_BLOCK_TOKENS = 512
_HEX16 = re.compile(r"^[0-9a-fA-F]{16}$")


class TraceFormatError(KvtierError, ValueError):
    """A trace line is not valid JSON or lacks a field the format requires."""


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt: when it arrived, how long it was, and the ids of its blocks in order.

    Only the last block may be partial (Mooncake lists ``ceil(input_tokens / block_tokens)``
    ids); the access log lists full chunks only, so its remainder tokens have no block.
    """

    ts_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[BlockId, ...]
    block_tokens: int
    session: str | None = None
    """The conversation or agent session it belongs to, when the trace says."""
    retention: tuple[int, float | None] | None = None
    """A hint: keep this prompt's blocks at this priority for this many seconds (``None``:
    until changed); set when the request is answered, as the connector does."""
    end: bool = False
    """A hint: the session ends with this request (its prefix is released)."""
    stop_reason: str | None = None
    """Why the answer ended (``tool_calls``, ``stop``, ...), when the trace says."""
    finish: tuple[int, float | None] | None = None
    """A hint set once the answer is known (the router's, from its stop reason): the whole
    prompt is set to it where that is stronger than what its blocks hold. Derived by
    ``--hints``, not read from a trace file."""

    @property
    def full_blocks(self) -> int:
        """Blocks whose every token is in the prompt: only these can count as hit tokens."""
        return min(len(self.blocks), self.input_tokens // self.block_tokens)


@dataclass(frozen=True)
class BadLine:
    lineno: int
    reason: str


@dataclass(frozen=True)
class Trace:
    """A whole trace in file order, with the one block size all its requests share."""

    requests: list[Request]
    block_tokens: int
    format: Format
    source: str
    skipped: tuple[BadLine, ...] = field(default=())
    ignored: int = 0
    """Access-log records that are not lookups (kept out of the replay on purpose)."""

    @property
    def accesses(self) -> int:
        return sum(len(r.blocks) for r in self.requests)


def load_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    skip_bad: bool = False,
) -> Trace:
    """Read a whole trace file; see :func:`read_lines` for the rules."""
    bad: list[BadLine] = []
    with open(path, encoding="utf-8") as stream:
        reader = TraceReader(str(path), fmt, block_tokens, skip_bad, bad.append)
        requests = list(reader.read(stream))
    if not requests:
        raise TraceFormatError(f"{path}: no requests in the trace")
    sizes = {r.block_tokens for r in requests}
    if len(sizes) > 1:
        raise TraceFormatError(f"{path}: the trace mixes block sizes {sorted(sizes)}")
    assert reader.format is not None  # set by the first request read
    return Trace(requests, sizes.pop(), reader.format, str(path), tuple(bad), reader.ignored)


class TraceReader:
    """Parses lines of one format (or detects it from the first record) into Requests."""

    def __init__(
        self,
        source: str,
        fmt: str = "auto",
        block_tokens: int = MOONCAKE_BLOCK_TOKENS,
        skip_bad: bool = False,
        on_bad: Callable[[BadLine], None] | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
        if block_tokens <= 0:
            raise TraceFormatError(f"block_tokens must be positive, got {block_tokens}")
        self.source = source
        self.format: Format | None = None if fmt == "auto" else cast(Format, fmt)
        self.block_tokens = block_tokens
        self.skip_bad = skip_bad
        self.on_bad = on_bad
        self.ignored = 0
        self._ids: dict[int, int] = {}
        """One int object per block id: a long trace's tuples share them (memory)."""

    def read(self, stream: TextIO) -> Iterator[Request]:
        for lineno, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                request = self.parse(line)
            except _Bad as exc:
                self._bad(lineno, str(exc))
                continue
            if request is not None:
                yield request

    def parse(self, line: str) -> Request | None:
        """One line's Request; ``None`` for an access-log record that is not a lookup."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _Bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(obj, dict):
            raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
        if self.format is None:
            self.format = _detect(obj)
        if self.format == "mooncake":
            return _mooncake(obj, self.block_tokens, self._ids)
        if obj.get("op") != "lookup":
            self.ignored += 1
            return None
        return _access_log(obj)

    def _bad(self, lineno: int, reason: str) -> None:
        if not self.skip_bad:
            raise TraceFormatError(f"{self.source}:{lineno}: {reason}")
        if self.on_bad is not None:
            self.on_bad(BadLine(lineno, reason))


class _Bad(Exception):
    """Why one line was refused; turned into TraceFormatError with its line number."""


def _detect(obj: dict[str, Any]) -> Format:
    if "hash_ids" in obj:
        return "mooncake"
    if "keys" in obj and "op" in obj:
        return "kvtier"
    raise _Bad(
        "cannot tell the format: expected Mooncake fields (timestamp, input_length, "
        "output_length, hash_ids) or a kvtier access-log record (ts, ns, op, keys, ...)"
    )


def _mooncake(obj: dict[str, Any], block_tokens: int, interned: dict[int, int]) -> Request:
    ts_ms = _number(obj, "timestamp")
    input_tokens = _count(obj, "input_length")
    output_tokens = _count(obj, "output_length")
    ids = _field(obj, "hash_ids")
    if not isinstance(ids, list) or not all(_is_count(i) for i in ids):
        raise _Bad("field 'hash_ids' must be a list of non-negative integers")
    expected = math.ceil(input_tokens / block_tokens)
    if len(ids) != expected:
        raise _Bad(
            f"'hash_ids' has {len(ids)} ids but input_length {input_tokens} needs "
            f"ceil({input_tokens}/{block_tokens}) = {expected}"
        )
    blocks = tuple(map(interned.setdefault, ids, ids))
    return Request(ts_ms / 1000.0, input_tokens, output_tokens, blocks, block_tokens,
                   *_hints(obj))


def _access_log(obj: dict[str, Any]) -> Request:
    ts = _number(obj, "ts")
    ns = _field(obj, "ns")
    if not isinstance(ns, str) or not _HEX16.match(ns):
        raise _Bad(f"field 'ns' must be 16 hex characters, got {ns!r}")
    chunk_tokens = _count(obj, "chunk_tokens")
    if chunk_tokens == 0:
        raise _Bad("field 'chunk_tokens' must be positive")
    prompt_tokens = _count(obj, "prompt_tokens")
    keys = _field(obj, "keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) and _HEX16.match(k) for k in keys):
        raise _Bad("field 'keys' must be a list of 16-hex-character key digests")
    if len(keys) * chunk_tokens > prompt_tokens:
        raise _Bad(
            f"{len(keys)} keys of {chunk_tokens} tokens exceed prompt_tokens {prompt_tokens}"
        )
    tiers = _field(obj, "tiers")
    if not isinstance(tiers, list) or len(tiers) != len(keys):
        raise _Bad("field 'tiers' must be a list as long as 'keys'")
    if not all(t is None or isinstance(t, str) for t in tiers):
        raise _Bad("field 'tiers' may hold only tier names or null")
    blocks = tuple(bytes.fromhex(k) for k in keys)
    return Request(float(ts), prompt_tokens, 0, blocks, chunk_tokens, *_hints(obj))


MAX_NAME = 200


def _hints(obj: dict[str, Any]) -> tuple[str | None, tuple[int, float | None] | None, bool,
                                         str | None]:
    """The optional hint fields of a record: ``session_id`` (a string or integer),
    ``retention`` ({priority, duration_s}), ``end`` (true or false), ``stop_reason``."""
    session = obj.get("session_id")
    if session is not None:
        if isinstance(session, bool) or not isinstance(session, str | int) or (
                len(str(session)) > MAX_NAME):
            raise _Bad(f"field 'session_id' must be a string or integer of at most {MAX_NAME} "
                       f"characters, got {session!r:.60}")
        session = str(session)
    retention = obj.get("retention")
    if retention is not None:
        if not isinstance(retention, dict) or not retention.keys() <= {"priority", "duration_s"}:
            raise _Bad("field 'retention' must be {\"priority\": 0-100, \"duration_s\": "
                       f"seconds or null}}, got {retention!r:.60}")
        try:
            checked = Retention(retention.get("priority", DEFAULT_PRIORITY),
                                retention.get("duration_s"))
        except ValueError as exc:
            raise _Bad(f"field 'retention': {exc}") from exc
        retention = (checked.priority, checked.duration_s)
    end = obj.get("end", False)
    if not isinstance(end, bool):
        raise _Bad(f"field 'end' must be true or false, got {end!r:.60}")
    stop = obj.get("stop_reason")
    if stop is not None and (not isinstance(stop, str) or len(stop) > MAX_NAME):
        raise _Bad(f"field 'stop_reason' must be a string of at most {MAX_NAME} characters")
    return session, retention, end, stop


def _field(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise _Bad(f"missing field {name!r}")
    return obj[name]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count(obj: dict[str, Any], name: str) -> int:
    value = _field(obj, name)
    if not _is_count(value):
        raise _Bad(f"field {name!r} must be a non-negative integer, got {value!r}")
    return int(value)


def _number(obj: dict[str, Any], name: str) -> float:
    value = _field(obj, name)
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise _Bad(f"field {name!r} must be a non-negative number, got {value!r}")
    return float(value)


def write_mooncake(requests: list[Request], stream: TextIO) -> None:
    """Write requests as Mooncake JSONL (timestamps rounded to whole milliseconds)."""
    for r in requests:
        record = {
            "timestamp": round(r.ts_s * 1000),
            "input_length": r.input_tokens,
            "output_length": r.output_tokens,
            "hash_ids": list(r.blocks),
        }
        if r.session is not None:
            record["session_id"] = r.session
        if r.retention is not None:
            record["retention"] = {"priority": r.retention[0], "duration_s": r.retention[1]}
        if r.end:
            record["end"] = True
        if r.stop_reason is not None:
            record["stop_reason"] = r.stop_reason
        stream.write(json.dumps(record, separators=(", ", ": ")) + "\n")


def show_block(block: BlockId) -> str:
    """A block id as people read it: the int, or the 16-hex digest of the access log."""
    return block.hex() if isinstance(block, bytes) else str(block)
