"""What a request may say about how long its KV is worth keeping (``kv_transfer_params.kvtier``).

The shape is TensorRT-LLM's retention config, in seconds::

    "kvtier": {
      "retention": {
        "priority": 80, "duration_s": 30,                 # the whole prompt
        "ranges": [{"start": 0, "end": 4096, "priority": 90, "duration_s": 300}],
        "decode_priority": 10, "decode_duration_s": 5     # chunks of generated tokens
      },
      "release": true,                                    # or: the prefix is done
      "finish": {"stop": {"priority": 60, "duration_s": 600},   # set when it finishes,
                 "length": {"priority": 60, "duration_s": 600}, # by how it finished
                 "tool_calls": {"priority": 80, "duration_s": 20},
                 "tool_call_tokens": [151657]}                  # what marks a tool call
    }

Each chunk of the prompt takes the highest priority among the ranges that overlap its tokens
(``end`` null: to the end of the prompt), else the whole-prompt retention, else the request's
``priority``, else the connector's default. A duration makes the priority fall back to the
default (35) that many seconds after it is set; none keeps it until changed. ``release``
drops the prompt's chunks to priority 0 when the request finishes. ``finish`` holds a
retention per way the engine can end a request (``stop``: an end-of-sequence or stop token,
``length``: ``max_tokens`` or the model's length, ``abort``: the client left, an error, or a
stop *string*, which vLLM 0.32 ends by aborting the request); the one for how it ended is
set on the request's chunks when it finishes, where it is stronger than what they hold (the
router sets it for a session's turn). The engine cannot tell a tool call from an end of turn
(both end on a stop token) unless it is told what starts one: with ``tool_call_tokens`` (the
model's tool-call marker, e.g. Qwen's ``<tool_call>``), an answer whose generated tokens
contain one of them ended in ``tool_calls``, however the engine ended it (a tool call often
ends on a stop string), and that entry is set instead. Everything is checked here (the
connector and the router parse the same way) and bounded: at most ``MAX_RANGES`` ranges,
priorities 0-100, durations in (0, ``MAX_RETAIN_S``] seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

from msgspec import Meta

from kvtier.config import ConfigStruct, parse
from kvtier.errors import ConfigError
from kvtier.policies.retention import MAX_RETAIN_S, MIN_PRIORITY

MAX_TOOL_CALL_TOKENS = 16
"""Token ids that may mark a tool call (a model has one or two; checked against every
generated token at finish)."""
MAX_RANGES = 8
"""Token ranges one request may give: enough for a system prompt, tools and turns. Each
run of equal retention is one blocking round trip in vLLM's scheduler loop (at store and at
finish), and ``n`` ranges make at most ``2n + 1`` runs: 17."""

Priority = Annotated[int, Meta(ge=0, le=100)]
Duration = Annotated[float, Meta(gt=0.0, le=MAX_RETAIN_S)]
Tokens = Annotated[int, Meta(ge=0, le=1 << 40)]
ChunkRetention = tuple[int, float | None]
"""A chunk's priority and duration in seconds (``None``: until changed)."""


class TokenRange(ConfigStruct, frozen=True):
    """Tokens ``[start, end)`` of the prompt (``end`` null: to its end) kept at ``priority``
    for ``duration_s`` seconds."""

    priority: Priority
    start: Tokens = 0
    end: Tokens | None = None
    duration_s: Duration | None = None

    def __post_init__(self) -> None:
        if self.end is not None and self.end <= self.start:
            raise ConfigError(f"end must be greater than start, got start {self.start}, "
                              f"end {self.end}")

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.start < hi and (self.end is None or lo < self.end)


class RetentionHint(ConfigStruct, frozen=True):
    """A request's retention: for the whole prompt, per token range, and for decode."""

    priority: Priority | None = None
    duration_s: Duration | None = None
    ranges: Annotated[tuple[TokenRange, ...], Meta(max_length=MAX_RANGES)] = ()
    decode_priority: Priority | None = None
    decode_duration_s: Duration | None = None

    def __post_init__(self) -> None:
        if self.duration_s is not None and self.priority is None:
            raise ConfigError("duration_s needs a priority (the priority it keeps that long)")
        if self.decode_duration_s is not None and self.decode_priority is None:
            raise ConfigError("decode_duration_s needs a decode_priority")

    def of_chunk(self, lo: int, hi: int, prompt_tokens: int,
                 default: ChunkRetention) -> ChunkRetention:
        """The retention of the chunk of tokens ``[lo, hi)``: the highest-priority range
        overlapping it (the longer duration among equals, none longest), else the whole
        prompt's, else ``default``; a chunk past the prompt takes the decode retention."""
        if lo >= prompt_tokens and self.decode_priority is not None:
            return self.decode_priority, self.decode_duration_s
        best: ChunkRetention | None = None
        for r in self.ranges:
            if r.overlaps(lo, hi) and (best is None or _rank(r.priority, r.duration_s)
                                       > _rank(*best)):
                best = (r.priority, r.duration_s)
        if best is not None:
            return best
        if self.priority is not None:
            return self.priority, self.duration_s
        return default


FINISH_REASONS = ("stop", "length", "abort")
"""How the engine can end a request (vLLM's ``FinishReason``, less what it never answers)."""


class Retain(ConfigStruct, frozen=True):
    """A priority kept for ``duration_s`` seconds (none: until changed)."""

    priority: Priority
    duration_s: Duration | None = None


class FinishRetention(ConfigStruct, frozen=True):
    """A retention per way the request may end, set on its chunks when it does."""

    stop: Retain | None = None
    length: Retain | None = None
    abort: Retain | None = None
    tool_calls: Retain | None = None
    """For an answer whose generated tokens hold one of ``tool_call_tokens``."""
    tool_call_tokens: tuple[int, ...] = ()
    """Token ids that start a tool call in the model's answers (e.g. Qwen's ``<tool_call>``):
    how the connector tells a tool call from an end of turn. At most 16, each in
    [0, 2^31)."""

    def __post_init__(self) -> None:
        check_tool_call_tokens(self.tool_call_tokens, "tool_call_tokens")
        if self.tool_calls is not None and not self.tool_call_tokens:
            raise ConfigError("tool_calls needs tool_call_tokens: the token ids that start a "
                              "tool call in the model's answers (the engine cannot tell a "
                              "tool call from an end of turn otherwise)")

    def of(self, reason: str | None, generated: Iterable[int] = ()) -> Retain | None:
        """The retention for ``reason`` (one of :data:`FINISH_REASONS`), if any; for
        ``tool_calls``'s when the answer (its ``generated`` token ids) holds a tool-call
        token, however it ended."""
        if reason not in FINISH_REASONS:
            return None
        if self.tool_calls is not None and self.is_tool_call(generated):
            return self.tool_calls
        retain: Retain | None = getattr(self, reason)
        return retain

    def is_tool_call(self, generated: Iterable[int]) -> bool:
        """Whether ``generated`` holds one of ``tool_call_tokens`` (one pass)."""
        marks = frozenset(self.tool_call_tokens)
        return bool(marks) and not marks.isdisjoint(generated)


def check_tool_call_tokens(ids: tuple[int, ...], where: str) -> None:
    """ConfigError naming ``where`` unless ``ids`` are at most ``MAX_TOOL_CALL_TOKENS`` token
    ids, each in [0, 2^31)."""
    if len(ids) > MAX_TOOL_CALL_TOKENS or not all(0 <= t < 1 << 31 for t in ids):
        shown = list(ids[:MAX_TOOL_CALL_TOKENS + 1])
        raise ConfigError(f"{where}: expected at most {MAX_TOOL_CALL_TOKENS} token ids, each "
                          f"in [0, 2^31), got {len(ids)}: {shown}")


def _rank(priority: int, duration_s: float | None) -> tuple[int, float]:
    return priority, float("inf") if duration_s is None else duration_s


def parse_retention(raw: object, where: str = "kv_transfer_params.kvtier.retention"
                    ) -> RetentionHint:
    """A request's retention; raises ConfigError naming the key and what is allowed."""
    return parse(RetentionHint, raw, where)


def chunk_retentions(hint: RetentionHint | None, n_chunks: int, chunk_tokens: int,
                     prompt_tokens: int, default: ChunkRetention) -> list[ChunkRetention]:
    """The retention of each of the first ``n_chunks`` chunks of a prompt."""
    if hint is None:
        return [default] * n_chunks
    return [hint.of_chunk(i * chunk_tokens, (i + 1) * chunk_tokens, prompt_tokens, default)
            for i in range(n_chunks)]


def runs(retentions: list[ChunkRetention], start: int = 0, end: int | None = None
         ) -> list[tuple[int, int, ChunkRetention]]:
    """Maximal runs ``(lo, hi, retention)`` of equal retention in ``retentions[start:end]``
    (one store call each)."""
    end = len(retentions) if end is None else end
    out: list[tuple[int, int, ChunkRetention]] = []
    lo = start
    for i in range(start + 1, end + 1):
        if i == end or retentions[i] != retentions[lo]:
            out.append((lo, i, retentions[lo]))
            lo = i
    return out if start < end else []


RELEASED: ChunkRetention = (MIN_PRIORITY, None)
"""What ``release: true`` sets on the prompt's chunks when the request finishes."""
