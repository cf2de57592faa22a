"""How late the router's event loop runs: every decision, lookup and byte passes through it.

A task on the loop wakes every :data:`TICK_S` and records how much later than asked it woke
(``kvtier_router_loop_lag_seconds``): a loop blocked by a callback that does not yield (a
long computation, a synchronous call, a collection of the heap) delays every request in
flight at once, and on a fleet that shows up as several clients' first tokens late together.
A watchdog thread, outside the loop, notices a loop that has not woken for
:data:`STALL_S` while it is still stuck, and logs what the loop's thread is running then (its
innermost frames): at most once every :data:`REPORT_EVERY_S`, with the number of stalls
since the last report, so a loop that stalls often is logged once a minute, not per stall.
A stall that holds the interpreter lock the whole time (a C call that does not release it)
keeps the watchdog out too: it is then counted in the histogram only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback

from prometheus_client import Histogram

log = logging.getLogger("kvtier.router")

__all__ = ["LoopWatch"]

TICK_S = 0.05
STALL_S = 0.25
REPORT_EVERY_S = 60.0
FRAMES = 12


class LoopWatch:
    def __init__(self, lag: Histogram | None = None, tick_s: float = TICK_S,
                 stall_s: float = STALL_S, report_every_s: float = REPORT_EVERY_S) -> None:
        self.lag = lag
        self.tick_s = tick_s
        self.stall_s = stall_s
        self.report_every_s = report_every_s
        self.stalls = 0
        """Stalls the watchdog saw (each counted once, however long)."""
        self._woke = time.monotonic()
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported_at = -float("inf")
        self._unreported = 0

    async def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._woke = time.monotonic()
        self._task = asyncio.create_task(self._ticks())
        self._thread = threading.Thread(target=self._watch, name="kvtier-loop-watch",
                                        daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2.0)

    async def _ticks(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.tick_s)
            self._woke = time.monotonic()
            if self.lag is not None:
                self.lag.observe(max(0.0, self._woke - asked - self.tick_s))

    def _watch(self) -> None:
        in_stall = False
        while not self._stop.wait(self.tick_s):
            late = time.monotonic() - self._woke - self.tick_s
            if late < self.stall_s:
                in_stall = False
                continue
            if in_stall:
                continue
            in_stall = True
            self.stalls += 1
            self._unreported += 1
            now = time.monotonic()
            if now - self._reported_at >= self.report_every_s:
                self._report(late, now)

    def _report(self, late: float, now: float) -> None:
        frame = sys._current_frames().get(self._loop_thread or -1)
        where = ("".join(traceback.format_stack(frame, limit=FRAMES)).rstrip()
                 if frame is not None else "(its thread is gone)")
        log.warning("the router's event loop has not run for %.2f s (%d such stalls since "
                    "the last report); it is running:\n%s", late, self._unreported, where)
        self._reported_at = now
        self._unreported = 0
