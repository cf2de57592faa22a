"""Structured logging for the server and CLI: one JSON object per line, or plain text."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup(level: str = "info", fmt: str = "json", stream: IO[str] | None = None) -> None:
    """kvtier's log lines to ``stream`` (default: stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("kvtier")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
