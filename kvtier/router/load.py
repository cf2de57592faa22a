"""What one backend is busy with, as the router sees it, and how fast it prefills.

Each request the router sends is a *flight* with the prefill time predicted when it was sent
(load + prefill, :mod:`kvtier.router.cost`). Prefills run one after another (vLLM schedules
them first come, first served, and they are compute bound), so the backend is a queue that
is busy until ``busy_until``::

    on send:                  busy_until = max(busy_until, now) + predicted
    on a first byte or end:   busy_until = now + sum of predicted over flights still prefilling
    wait = max(0, busy_until - now) + others * mean_prefill_s

Every flight also decodes beside a newcomer (now, or once prefilled), sharing the backend's
steps: the ``cache`` strategy adds ``decode_weight * decode_s`` for each (``decode_s``: how
long a request decoded here, from streams' first to last byte).

The second line corrects the queue whenever a prefill ends sooner or later than predicted. A
flight is prefilling until its first streamed byte (a whole answer's first byte is its last).

``others`` are requests the backend runs or queues that this router did not send
(``vllm:num_requests_running + vllm:num_requests_waiting`` at the last poll, less the router's
own flights then). A flight that prefilled while nothing else was in flight is a clean
speed sample: its recomputed tokens over its TTFT less its load time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass
class Flight:
    sent: float
    predicted_s: float
    first_byte: float | None = None
    alone: bool = True


class Ema:
    """An exponential moving average that starts from a default."""

    def __init__(self, default: float, alpha: float) -> None:
        self.value = default
        self.alpha = alpha
        self.samples = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else (
            self.alpha * sample + (1 - self.alpha) * self.value)
        self.samples += 1


class BackendLoad:
    def __init__(self, prefill_tokens_per_s: float, alpha: float) -> None:
        self._flights: dict[int, Flight] = {}
        self._ids = itertools.count()
        self.others = 0
        self.busy_until = 0.0
        self.speed = Ema(prefill_tokens_per_s, alpha)
        """Prefill tokens per second."""
        self.mean_prefill_s = Ema(0.0, alpha)
        self.itl_s = Ema(0.0, alpha)
        """Seconds between streamed chunks (to take decoding out of whole responses)."""
        self.decode_s = Ema(0.0, alpha)
        """Seconds from a streamed answer's first byte to its last: how long a request
        decodes on this backend (0 until a stream has been seen)."""

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def wait_s(self, now: float) -> float:
        return max(0.0, self.busy_until - now) + self.others * self.mean_prefill_s.value

    def start(self, predicted_s: float, now: float) -> int:
        alone = self.others == 0
        for other in self._flights.values():
            if other.first_byte is None:
                other.alone = False
                alone = False
        fid = next(self._ids)
        self._flights[fid] = Flight(now, predicted_s, alone=alone)
        self.busy_until = max(self.busy_until, now) + predicted_s
        self.mean_prefill_s.add(predicted_s)
        return fid

    def first_byte(self, fid: int, now: float) -> None:
        flight = self._flights.get(fid)
        if flight is not None and flight.first_byte is None:
            flight.first_byte = now
            self._requeue(now)

    def finish(self, fid: int, now: float) -> Flight | None:
        flight = self._flights.pop(fid, None)
        if flight is not None:
            self._requeue(now)
        return flight

    def _requeue(self, now: float) -> None:
        self.busy_until = now + sum(f.predicted_s for f in self._flights.values()
                                    if f.first_byte is None)

    def observe(self, running: int, waiting: int) -> None:
        """The backend's own queue, from its /metrics."""
        self.others = max(0, running + waiting - len(self._flights))

    def clear(self) -> None:
        """The backend went away: its flights are failing, its queue is gone."""
        self._flights.clear()
        self.others = 0
        self.busy_until = 0.0
