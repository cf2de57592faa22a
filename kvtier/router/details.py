"""Taking what says which prompt tokens were cached out of answers for tenants not allowed to
see it: ``kv_transfer_params.kvtier`` (per-tier details: where each prompt token came from)
and ``usage.prompt_tokens_details.cached_tokens`` (how many came from a cache: ``kvtier
serve`` starts vLLM with ``--enable-prompt-tokens-details``, and vLLM counts kvtier's hits).

Both tell a client which of its tokens were already cached: a side channel on what else was
asked (the prefix-cache inference attack). Whole JSON answers are decoded, stripped and
re-encoded; streamed answers — the last event of a stream with ``stream_options.include_usage``
and every event with ``continuous_usage_stats`` carry ``usage``; a later vLLM or another engine
may put ``kv_transfer_params`` on an event — are filtered line by line: a partial line is held
back until its end arrives, so an event split across reads cannot slip through.
"""

from __future__ import annotations

import json
from typing import Any

MARKS = (b'"kv_transfer_params"', b'"prompt_tokens_details"')
"""An answer without either key has nothing to strip (and is passed on unparsed)."""


def _marked(data: bytes) -> bool:
    return any(mark in data for mark in MARKS)


def strip_details(doc: Any) -> bool:
    """Removes ``kv_transfer_params.kvtier`` and ``usage.prompt_tokens_details.
    cached_tokens`` from a decoded answer in place; True if it had either. What is left
    empty becomes null, as vLLM sends it without them."""
    if not isinstance(doc, dict):
        return False
    return _strip_params(doc) | _strip_cached(doc)


def _strip_params(doc: dict[str, Any]) -> bool:
    params = doc.get("kv_transfer_params")
    if not isinstance(params, dict) or "kvtier" not in params:
        return False
    del params["kvtier"]
    if not params:
        doc["kv_transfer_params"] = None
    return True


def _strip_cached(doc: dict[str, Any]) -> bool:
    usage = doc.get("usage")
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    del details["cached_tokens"]
    if not details:
        usage["prompt_tokens_details"] = None
    return True


def strip_body(body: bytes) -> bytes:
    """A whole answer without the details (unchanged if it has none or is not JSON)."""
    if not _marked(body):
        return body
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    return json.dumps(doc).encode() if strip_details(doc) else body


def _strip_line(line: bytes) -> bytes:
    if not _marked(line) or not line.startswith(b"data:"):
        return line
    try:
        doc = json.loads(line[5:])
    except ValueError:
        return line
    return b"data: " + json.dumps(doc).encode() if strip_details(doc) else line


class StreamStripper:
    """Feeds an SSE stream through, complete lines only, without the details."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._pending + chunk
        end = data.rfind(b"\n") + 1
        self._pending = data[end:]
        if not _marked(data[:end]):
            return data[:end]
        return b"\n".join(_strip_line(line) for line in data[:end].split(b"\n"))

    def flush(self) -> bytes:
        """What is left at the end of the stream (a last line without its newline)."""
        rest, self._pending = self._pending, b""
        return _strip_line(rest)
