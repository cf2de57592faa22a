"""How an answer ended: the ``finish_reason`` of its choices, whole or streamed.

A streamed answer's reason is in one of its last ``data:`` events; the events arrive in
whatever pieces the backend's writes make, so a line cut between two pieces is carried over
(at most :data:`MAX_CARRY` bytes: a longer line is skipped, it is a content chunk). Of
several choices, ``tool_calls`` wins (a session that calls a tool continues), else the last
reason seen.
"""

from __future__ import annotations

import json
from typing import Any

MAX_CARRY = 64 << 10
_MARK = b'"finish_reason"'
TOOL_CALLS = "tool_calls"


def of_doc(doc: dict[str, Any] | None) -> str | None:
    """The finish reason of a whole answer (or of one streamed event)."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    found: str | None = None
    for choice in choices if isinstance(choices, list) else ():
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        if isinstance(reason, str) and reason and found != TOOL_CALLS:
            found = reason[:32]
    return found


class FinishWatch:
    """Fed a stream's pieces in order; ``reason`` is how it ended so far."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._carry = b""

    def feed(self, piece: bytes) -> None:
        data = self._carry + piece
        head, _, self._carry = data.rpartition(b"\n")
        if len(self._carry) > MAX_CARRY:
            self._carry = b""
        if _MARK in head:
            for line in head.split(b"\n"):
                if line.startswith(b"data:") and _MARK in line:
                    self._line(line[5:])

    def _line(self, payload: bytes) -> None:
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):
            return
        reason = of_doc(doc if isinstance(doc, dict) else None)
        if reason is not None and self.reason != TOOL_CALLS:
            self.reason = reason
