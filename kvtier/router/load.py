"""What one backend is busy with, as the router sees it, and how fast it prefills and decodes.

Each request the router sends is a *flight* with the prefill time predicted when it was sent
(load + prefill, :mod:`kvtier.router.cost`). Prefills run one after another (vLLM schedules
them first come, first served, and they are compute bound), so the backend is a queue that
is busy until ``busy_until``::

    on send:                  busy_until = max(busy_until, now) + predicted
    on a first byte or end:   busy_until = now + sum of predicted over flights still prefilling
    wait = max(0, busy_until - now) + others * mean_prefill_s

The second line corrects the queue whenever a prefill ends sooner or later than predicted. A
flight is prefilling until its first streamed byte (a whole answer's first byte is its last).

``others`` are requests the backend runs or queues that this router did not send
(``vllm:num_requests_running + vllm:num_requests_waiting`` at the last poll, less the router's
own flights then). A flight that prefilled while nothing else was in flight is a clean
speed sample: its recomputed tokens over its TTFT less its load time.

Every flight also decodes beside a newcomer (now, or once prefilled), sharing the backend's
steps. How much each stream adds to a step is measured, not assumed: each streamed answer is
a sample of the time between its chunks against the streams decoding beside it (their count
averaged over its time from first byte to end), kept per count (:class:`StepModel`); the
slope of step time over count is the seconds one more stream adds to every step. The ``cache``
strategy turns it into a crowding cost (:meth:`BackendLoad.crowding_s`): the steps a newcomer
would share with each stream there, by when that stream began and will end. A router's backends
share one step model: the instances behind one router run one model on like hardware, and a
fit per backend, each on its own few samples, differed by its noise (one backend's slope
still unknown, 0 crowding, while the other's was measured) and sent every request to the
backend whose crowding was not yet counted.
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
    area_at_first_byte: float = 0.0
    mean_decoding: float | None = None
    """Streams decoding on the backend while this one did (itself included), averaged over
    its time from first byte to end; set at its end."""


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


class StepModel:
    """A backend's decode step time against how many streams decode together. Samples are
    kept by their nearest count (1 to :attr:`MAX_STREAMS`; more count as the most), each
    count a moving average of its samples' streams and step times; the slope is the
    least-squares line through those points, each weighted by its samples (up to 10)."""

    MAX_STREAMS = 32

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self._by_count: dict[int, tuple[Ema, Ema]] = {}

    def add(self, streams: float, step_s: float) -> None:
        if not (step_s > 0 and streams > 0):  # also drops NaN
            return
        streams = min(float(self.MAX_STREAMS), max(1.0, streams))
        x, y = self._by_count.setdefault(round(streams), (Ema(0.0, self.alpha),
                                                          Ema(0.0, self.alpha)))
        x.add(streams)
        y.add(step_s)

    @property
    def points(self) -> dict[int, tuple[float, float]]:
        """Each count's mean streams and mean step time."""
        return {n: (x.value, y.value) for n, (x, y) in sorted(self._by_count.items())}

    def slope_s(self) -> float | None:
        """Seconds one more stream adds to each step (never below 0), or None until the
        samples' streams spread (a standard deviation of a quarter stream or more)."""
        points = [(x.value, y.value, min(y.samples, 10)) for x, y in self._by_count.values()]
        if not points:
            return None
        total = sum(w for _, _, w in points)
        mean_x = sum(x * w for x, _, w in points) / total
        mean_y = sum(y * w for _, y, w in points) / total
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        if spread / total < 0.25 ** 2:
            return None
        return max(0.0, sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread)


class BackendLoad:
    def __init__(self, prefill_tokens_per_s: float, alpha: float,
                 steps: StepModel | None = None) -> None:
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
        self.steps = StepModel(alpha) if steps is None else steps
        """Time between streamed chunks against the streams decoding together; one model
        shared by a pool's backends (:class:`kvtier.router.backends.BackendPool`)."""
        self._area = 0.0
        """Streams decoding here, integrated over time (to :attr:`_area_at`)."""
        self._area_at: float | None = None

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    @property
    def decoding(self) -> int:
        """Streams decoding here now: the router's flights past their first byte, and the
        others."""
        return sum(1 for f in self._flights.values() if f.first_byte is not None) + self.others

    def crowding_s(self, now: float) -> float:
        """What decoding here costs a newcomer sent ``now`` beyond decoding alone, and it the
        streams beside it, as measured: each step it shares with another stream is ``slope``
        longer for both. The newcomer decodes from when its prefill could end (the queue,
        then a mean prefill) for an answer's decode time; each of the router's flights from
        its first byte (still prefilling: its predicted one, no later than the newcomer's)
        for the same; their overlap in steps counts twice (it, and them). A stream about to
        end costs a newcomer little, one just starting its whole answer. The backend's
        others, whose progress the router does not see, count 1.5 answers each (the
        newcomer's, and half of theirs). 0 until measured."""
        slope = self.steps.slope_s()
        itl = self.itl_s.value
        if slope is None or itl <= 0:
            return 0.0
        answer = self.decode_s.value
        start = now + self.wait_s(now) + self.mean_prefill_s.value
        shared = 0.0
        for f in self._flights.values():
            begins = f.first_byte if f.first_byte is not None else min(
                start, max(now, f.sent + f.predicted_s))
            shared += max(0.0, min(begins + answer - start, answer))
        return slope * (2 * shared + 1.5 * self.others * answer) / itl

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
            self._advance(now)
            flight.first_byte = now
            flight.area_at_first_byte = self._area
            self._requeue(now)

    def finish(self, fid: int, now: float) -> Flight | None:
        flight = self._flights.get(fid)
        if flight is not None:
            self._advance(now)
            if flight.first_byte is not None and now > flight.first_byte:
                flight.mean_decoding = (self._area - flight.area_at_first_byte) / (
                    now - flight.first_byte)
            del self._flights[fid]
            self._requeue(now)
        return flight

    def _advance(self, now: float) -> None:
        """Integrate the streams decoding up to ``now`` (before they change)."""
        if self._area_at is not None and now > self._area_at:
            self._area += self.decoding * (now - self._area_at)
        self._area_at = now if self._area_at is None else max(self._area_at, now)

    def _requeue(self, now: float) -> None:
        self.busy_until = now + sum(f.predicted_s for f in self._flights.values()
                                    if f.first_byte is None)

    def observe(self, running: int, waiting: int, now: float | None = None) -> None:
        """The backend's own queue, from its /metrics (read at ``now``)."""
        if now is not None:
            self._advance(now)
        self.others = max(0, running + waiting - len(self._flights))

    def clear(self) -> None:
        """The backend went away: its flights are failing, its queue is gone."""
        self._flights.clear()
        self.others = 0
        self.busy_until = 0.0
