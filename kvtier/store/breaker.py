"""A circuit breaker per lower tier: the seeds' rollback rule, automated.

::

    CLOSED ──failures over budget in the window──► OPEN ──cool-down──► HALF_OPEN
       ▲                                             ▲                     │ probe
       └────────────────── probe passed ─────────────┼─────────────────────┤
                                                     └──── probe failed ───┘

While the breaker is not CLOSED the tier is bypassed: lookups skip it, nothing new is
written to it, and serving goes on from the tiers above (and recompute). A failure is an
I/O error, an operation slower than ``latency_budget_s``, or one that did not finish within
the tier's ``io_timeout_s``. The store runs the probe (a small write, read and delete) and
reports its result; every transition is one call to ``on_change`` (one log line, one metric
update), never one per chunk.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

from kvtier.config import BreakerConfig


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


OnChange = Callable[["BreakerState", "BreakerState", str], None]


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, clock: Callable[[], float],
                 on_change: OnChange) -> None:
        self.config = config
        self.clock = clock
        self.on_change = on_change
        self.state = BreakerState.CLOSED
        self._window: deque[tuple[float, bool]] = deque()
        self._opened_at = 0.0

    def allows(self) -> bool:
        """Whether the tier may be read from and written to now."""
        return self.state is BreakerState.CLOSED or not self.config.enabled

    def record(self, ok: bool, seconds: float, error: str = "") -> None:
        """The outcome of one operation on the tier (ignored unless CLOSED: operations
        started before the breaker opened say nothing about the probe)."""
        if not self.config.enabled or self.state is not BreakerState.CLOSED:
            return
        now = self.clock()
        slow = seconds > self.config.latency_budget_s
        self._window.append((now, ok and not slow))
        while self._window and self._window[0][0] < now - self.config.window_s:
            self._window.popleft()
        failed = sum(1 for _, good in self._window if not good)
        if (failed >= self.config.errors
                and failed >= self.config.error_ratio * len(self._window)):
            cause = error or (f"took {seconds:.3f} s, over the budget of "
                              f"{self.config.latency_budget_s} s" if slow else "failed")
            self._open(f"{failed} of {len(self._window)} operations failed or were too slow "
                       f"in {self.config.window_s:g} s (last: {cause})")

    def trip(self, reason: str) -> None:
        """Open now (the tier failed where one failure is enough: its listing at start)."""
        if self.config.enabled and self.state is not BreakerState.OPEN:
            self._open(reason)

    def probe_due(self) -> bool:
        """OPEN for the cool-down: move to HALF_OPEN and tell the caller to probe now."""
        if (self.state is BreakerState.OPEN
                and self.clock() - self._opened_at >= self.config.cooldown_s):
            self._move(BreakerState.HALF_OPEN, "cool-down over, probing")
            return True
        return False

    def probe_result(self, ok: bool, seconds: float, error: str = "") -> None:
        if self.state is not BreakerState.HALF_OPEN:
            return
        if ok and seconds <= self.config.latency_budget_s:
            self._window.clear()
            self._move(BreakerState.CLOSED, f"probe passed in {seconds:.3f} s")
        else:
            self._open(f"probe failed: {error or f'took {seconds:.3f} s'}")

    def _open(self, reason: str) -> None:
        self._opened_at = self.clock()
        self._window.clear()
        self._move(BreakerState.OPEN, reason)

    def _move(self, state: BreakerState, reason: str) -> None:
        old, self.state = self.state, state
        if old is not state:
            self.on_change(old, state, reason)
