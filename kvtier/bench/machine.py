"""What the machine lost to others while a run ran: CPU steal and I/O wait (Linux).

A virtual machine's CPUs can be taken by its host for a while ("steal" in ``/proc/stat``):
every process on it stops together, and on a fleet of instances sharing the machine every
request in flight is late together, whatever routed it. A benchmark that does not record
steal reads such a spell as its own tail. :class:`MachineWatch` samples ``/proc/stat``
every ``interval_s`` while a run runs and :func:`summarize` reports the totals and the
*spells*: stretches where steal took at least ``SPELL_CPUS`` of a CPU, on the run's own
clock, so that a slow request can be checked against them (``start_s`` inside a spell).
Elsewhere than Linux the watch records nothing (``None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

STAT = "/proc/stat"
SPELL_CPUS = 0.25
"""Steal at this rate (CPUs' worth) or more makes a spell."""
MAX_SPELLS = 50
_HZ = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
"""/proc/stat's ticks a second."""


@dataclass(frozen=True)
class Sample:
    at_s: float
    """On the run's clock."""
    total_s: float
    """CPU seconds of every kind, over all CPUs, since boot."""
    iowait_s: float
    steal_s: float


def read_stat(path: str = STAT) -> tuple[float, float, float] | None:
    """(total, iowait, steal) CPU seconds since boot from the ``cpu`` line of ``path``, or
    None where there is no such file or line."""
    try:
        with open(path) as f:
            line = f.readline()
    except OSError:
        return None
    fields = line.split()
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        ticks = [int(v) for v in fields[1:]]
    except ValueError:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user, nice]
    return sum(ticks[:8]) / _HZ, ticks[4] / _HZ, ticks[7] / _HZ


def summarize(samples: Sequence[Sample], spell_cpus: float = SPELL_CPUS) -> dict[str, Any] | None:
    """Totals over the samples and the spells of steal (``[start_s, end_s, cpu_s]``, at most
    :data:`MAX_SPELLS`, the longest kept), or None with fewer than two samples."""
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    elapsed = last.at_s - first.at_s
    spells: list[list[float]] = []
    open_spell: list[float] | None = None
    worst = 0.0
    for a, b in itertools.pairwise(samples):
        dt = b.at_s - a.at_s
        stolen = b.steal_s - a.steal_s
        rate = stolen / dt if dt > 0 else 0.0
        worst = max(worst, rate)
        if rate >= spell_cpus:
            if open_spell is None:
                open_spell = [a.at_s, b.at_s, 0.0]
                spells.append(open_spell)
            open_spell[1] = b.at_s
            open_spell[2] += stolen
        else:
            open_spell = None
    if len(spells) > MAX_SPELLS:
        spells = sorted(sorted(spells, key=lambda s: s[1] - s[0])[-MAX_SPELLS:])
    total = last.total_s - first.total_s
    stolen_all = last.steal_s - first.steal_s
    return {
        "seconds": round(elapsed, 3),
        "steal_cpu_s": round(stolen_all, 3),
        "iowait_cpu_s": round(last.iowait_s - first.iowait_s, 3),
        "steal_share": round(stolen_all / total, 4) if total > 0 else None,
        "worst_steal_cpus": round(worst, 3),
        "steal_spells": [[round(s, 3), round(e, 3), round(c, 3)] for s, e, c in spells],
    }


class MachineWatch:
    """Samples ``/proc/stat`` every ``interval_s`` on the running event loop (a file read,
    microseconds) until :meth:`stop`; ``clock`` is the run's (seconds since its start)."""

    def __init__(self, clock: Callable[[], float], interval_s: float = 0.25,
                 path: str = STAT) -> None:
        self.clock = clock
        self.interval_s = interval_s
        self.path = path
        self.samples: list[Sample] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if read_stat(self.path) is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def sample(self) -> None:
        stat = read_stat(self.path)
        if stat is not None:
            self.samples.append(Sample(self.clock(), *stat))

    async def stop(self) -> dict[str, Any] | None:
        if self._task is None:
            return None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sample()
        return summarize(self.samples)
