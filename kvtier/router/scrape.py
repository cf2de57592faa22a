"""The few numbers the router reads from a vLLM backend's /metrics (Prometheus text)."""

from __future__ import annotations

import contextlib
import re
from typing import NamedTuple

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class EngineGauges(NamedTuple):
    running: int
    waiting: int
    device_tokens: int | None


def engine_gauges(text: str) -> EngineGauges:
    """``vllm:num_requests_running`` / ``_waiting`` summed over engines, and the device KV
    cache size (``vllm:cache_config_info``: num_gpu_blocks x block_size, summed)."""
    running = waiting = 0.0
    device = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if name == "vllm:num_requests_running":
            running += _number(value)
        elif name == "vllm:num_requests_waiting":
            waiting += _number(value)
        elif name == "vllm:cache_config_info":
            found = dict(_LABEL.findall(labels or ""))
            with contextlib.suppress(KeyError, ValueError):
                device += int(found["num_gpu_blocks"]) * int(found["block_size"])
    return EngineGauges(int(running), int(waiting), device or None)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0
