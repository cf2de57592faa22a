"""What the router learns from each answer: metrics, and the backend's prefill speed.

Counts every answer by backend, endpoint and status, its latency and first byte; for the
``cache`` strategy's predictions, the predicted and the reported sources of the prompt's
tokens (``kv_transfer_params.kvtier.tokens``); and, from a request that had its backend to
itself, a prefill-speed sample (recomputed tokens over TTFT less load time; a backend not
measured yet takes its measured peers' mean) and, from
streams, the time between chunks and the time from first to last byte (decoding), and the
time between chunks against the streams that decoded beside it (the step model).
"""

from __future__ import annotations

import time
from typing import Any

from kvtier.router.backends import Backend, BackendPool
from kvtier.router.cost import RECOMPUTED, dominant
from kvtier.router.load import Flight
from kvtier.router.metrics import RouterMetrics
from kvtier.router.proxy import Outcome
from kvtier.router.request import RoutedRequest
from kvtier.router.strategies import Decision


class Accounting:
    def __init__(self, metrics: RouterMetrics, min_sample_tokens: int,
                 pool: BackendPool) -> None:
        self.metrics = metrics
        self.min_sample_tokens = min_sample_tokens
        self.pool = pool
        """Whose unmeasured backends take their measured peers' prefill speed."""

    def record(self, req: RoutedRequest, decision: Decision, outcome: Outcome,
                 flight: Flight | None, received: float) -> dict[str, int] | None:
        """Counts one answer; returns its actual sources of prompt tokens when it reported
        them (``kv_transfer_params.kvtier.tokens``)."""
        backend, m = decision.backend, self.metrics
        now = time.monotonic()
        m.requests.labels(backend.name, req.endpoint, str(outcome.status)).inc()
        m.latency.labels(backend.name, req.endpoint).observe(now - received)
        if outcome.first_byte is not None:
            m.first_byte.labels(backend.name).observe(outcome.first_byte - received)
        if outcome.status != 200:
            return None
        if outcome.streamed and outcome.chunks >= 3 and outcome.first_byte and outcome.last_byte:
            itl = (outcome.last_byte - outcome.first_byte) / (outcome.chunks - 1)
            backend.load.itl_s.add(itl)
            backend.load.decode_s.add(outcome.last_byte - outcome.first_byte)
            if flight is not None and flight.mean_decoding is not None:
                backend.load.steps.add(flight.mean_decoding, itl)
        actual = _actual_sources(outcome.doc)
        pred = decision.prediction
        if pred is not None:
            m.predicted_ttft.labels(backend.name).observe(pred.ttft_s)
            if actual is not None:
                for source, tokens in pred.sources.items():
                    m.predicted_tokens.labels(backend.name, source).inc(tokens)
        if actual is not None:
            for source, tokens in actual.items():
                m.actual_tokens.labels(backend.name, source).inc(tokens)
            m.hit_source.labels(pred.dominant if pred else "unknown", dominant(actual)).inc()
        if flight is not None:
            self._speed_sample(backend, decision, outcome, flight, actual)
        return actual

    def _speed_sample(self, backend: Backend, decision: Decision, outcome: Outcome,
                      flight: Flight, actual: dict[str, int] | None) -> None:
        """Recomputed tokens over prefill time, from a request that had the backend alone."""
        pred = decision.prediction
        if not flight.alone or outcome.first_byte is None or pred is None:
            return
        recomputed = actual.get(RECOMPUTED) if actual else pred.sources.get(RECOMPUTED)
        if recomputed is None or recomputed < self.min_sample_tokens:
            return
        ttft = outcome.first_byte - flight.sent
        if not outcome.streamed:  # the first byte of a whole answer is its last
            usage = (outcome.doc or {}).get("usage") or {}
            try:
                generated = int(usage.get("completion_tokens") or 1)
            except (TypeError, ValueError):
                return
            ttft -= max(0, generated - 1) * backend.load.itl_s.value
        prefill = ttft - pred.load_s
        if prefill > 0.001:
            backend.load.speed.add(recomputed / prefill)
            self.pool.share_speed()


def _actual_sources(doc: dict[str, Any] | None) -> dict[str, int] | None:
    """``kv_transfer_params.kvtier.tokens`` of a response, if it has them."""
    params = (doc or {}).get("kv_transfer_params")
    kvtier = params.get("kvtier") if isinstance(params, dict) else None
    tokens = kvtier.get("tokens") if isinstance(kvtier, dict) else None
    if not isinstance(tokens, dict):
        return None
    try:
        return {str(k): int(v) for k, v in tokens.items()}
    except (TypeError, ValueError):
        return None
