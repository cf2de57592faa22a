"""Taking ``kv_transfer_params.kvtier`` (per-tier details: where each prompt token came from)
out of answers for tenants not allowed to see them.

Those details tell a client which of its tokens were already cached, and where: a side
channel on what else was asked (the prefix-cache inference attack). Whole JSON answers are
decoded, stripped and re-encoded; streamed answers (vLLM 0.32 puts no ``kv_transfer_params``
on chunks, but a later version or another engine may) are filtered line by line: a partial
line is held back until its end arrives, so an event split across reads cannot slip through.
"""

from __future__ import annotations

import json
from typing import Any

MARK = b'"kv_transfer_params"'


def strip_details(doc: Any) -> bool:
    """Removes ``kv_transfer_params.kvtier`` from a decoded answer in place; True if it had
    one. ``kv_transfer_params`` left empty becomes null, as vLLM sends it without params."""
    if not isinstance(doc, dict):
        return False
    params = doc.get("kv_transfer_params")
    if not isinstance(params, dict) or "kvtier" not in params:
        return False
    del params["kvtier"]
    if not params:
        doc["kv_transfer_params"] = None
    return True


def strip_body(body: bytes) -> bytes:
    """A whole answer without the details (unchanged if it has none or is not JSON)."""
    if MARK not in body:
        return body
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    return json.dumps(doc).encode() if strip_details(doc) else body


def _strip_line(line: bytes) -> bytes:
    if MARK not in line or not line.startswith(b"data:"):
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
        if MARK not in data[:end]:
            return data[:end]
        return b"\n".join(_strip_line(line) for line in data[:end].split(b"\n"))

    def flush(self) -> bytes:
        """What is left at the end of the stream (a last line without its newline)."""
        rest, self._pending = self._pending, b""
        return _strip_line(rest)
