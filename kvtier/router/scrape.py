"""The few numbers the router reads from a vLLM backend's /metrics (Prometheus text)."""

from __future__ import annotations

import math
from typing import NamedTuple

from kvtier.prom import samples

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"


class EngineGauges(NamedTuple):
    running: int
    waiting: int
    device_tokens: int | None


def engine_gauges(text: str) -> EngineGauges:
    """``vllm:num_requests_running`` / ``_waiting`` summed over engines, and the device KV
    cache size (``vllm:cache_config_info``: num_gpu_blocks x block_size, summed). A page that
    is not Prometheus text gives zeros and no size (:func:`kvtier.prom.samples`)."""
    running = waiting = 0.0
    device = 0
    for s in samples(text, (RUNNING, WAITING, CACHE_CONFIG)):
        if s.name == RUNNING:
            running += s.value
        elif s.name == WAITING:
            waiting += s.value
        else:
            device += _device_tokens(s.labels)
    return EngineGauges(_count(running), _count(waiting), device or None)


def _device_tokens(labels: dict[str, str]) -> int:
    try:
        return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    except (KeyError, ValueError):
        return 0


def _count(value: float) -> int:
    """A gauge as a count; NaN and infinities (which a broken backend may send) count 0."""
    return int(value) if math.isfinite(value) else 0
