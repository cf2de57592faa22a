"""The router's event-loop watch (kvtier.router.lag): a loop blocked by a callback that does
not yield is measured, and what blocks it is logged while it blocks, once per report
interval however often it happens."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvtier.router.lag import LoopWatch


def _blocks_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # the bug being caught: a synchronous wait on the loop


def test_a_blocked_loop_is_measured_and_its_culprit_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    lag = Histogram("lag_seconds", "test", buckets=(0.01, 0.1, 0.5, 2.0), registry=registry)

    async def run() -> LoopWatch:
        # a stall and its blocks well apart from what a busy machine pauses a loop
        watch = LoopWatch(lag, tick_s=0.02, stall_s=0.3, report_every_s=60.0)
        await watch.start()
        await asyncio.sleep(0.2)  # quiet: no stall
        quiet = watch.stalls
        _blocks_the_loop(0.9)
        await asyncio.sleep(0.1)
        _blocks_the_loop(0.9)
        await asyncio.sleep(0.1)
        await watch.stop()
        assert quiet == 0
        return watch

    with caplog.at_level(logging.WARNING, logger="kvtier.router"):
        watch = asyncio.run(run())
    assert watch.stalls == 2
    slow = registry.get_sample_value("lag_seconds_count") - registry.get_sample_value(
        "lag_seconds_bucket", {"le": "0.5"})
    assert slow == 2  # two ticks woke over 0.5 s late, the rest on time
    warnings = [r for r in caplog.records if "event loop has not run" in r.getMessage()]
    assert len(warnings) == 1  # the second stall falls in the same report interval
    assert "_blocks_the_loop" in warnings[0].getMessage()


def test_a_watch_never_started_stops_cleanly() -> None:
    asyncio.run(LoopWatch().stop())
