"""The store's one lock, each hold timed; and how components change state through it.

Only :class:`~kvtier.store.core.TieredStore` takes the store lock (a :class:`StoreLock`).
A component whose work ends on another thread (an I/O job's outcome, the housekeeper, a
shared tier's journal) hands the change to the store's
:meth:`~kvtier.store.core.TieredStore.apply` (an :class:`Apply`)::

    apply(section, change, wake=False)
                             take the lock, run change(), record the hold under ``section``
                             (``max_s``: the lock-hold figures), wake the store's waiters if
                             ``wake`` (the change may end what they wait for: a write, delete
                             or promotion done), let go; returns what change() returned

so every hold is timed and every outcome is applied in one place. A change must not call
``apply`` again (the lock is not reentrant): code that already runs under the lock (a
callback of an overdue job, say) changes the state directly. A wait on the store's
condition ends one timed hold and waking up begins the next, so a long wait is never
counted as a long hold.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

T = TypeVar("T")


class Apply(Protocol):
    def __call__(self, section: str, change: Callable[[], T], /, *, wake: bool = False
                 ) -> T: ...


class Hold:
    """One hold of the store lock, timed from :meth:`begin` to :meth:`end`."""

    def __init__(self, cond: threading.Condition, lock: StoreLock, section: str) -> None:
        self.cond = cond
        self.lock = lock
        self.section = section
        self.begin()

    def begin(self) -> None:
        self.start, self.cpu = time.perf_counter(), time.thread_time()

    def end(self) -> None:
        self.lock.record(self.section, time.perf_counter() - self.start,
                         time.thread_time() - self.cpu)

    def wait(self, timeout: float) -> None:
        """Let go of the lock until notified or ``timeout`` passes (not counted as held)."""
        self.end()
        self.cond.wait(timeout)
        self.begin()

    def notify_all(self) -> None:
        """Wake whoever waits on the store (their condition may have changed)."""
        self.cond.notify_all()


class StoreLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.max_s: dict[str, float] = {}
        """The longest hold per section, in wall time (what other clients waited)."""
        self.cpu_max_s: dict[str, float] = {}
        """The longest hold per section in the holding thread's CPU time (the store's own
        work, which a busy machine's preemption does not inflate)."""
        self.holds: dict[str, int] = {}
        """Holds per section so far (work split into bounded batches shows as many)."""

    @contextlib.contextmanager
    def held(self, section: str) -> Iterator[Hold]:
        with self._lock:
            hold = Hold(self._cond, self, section)
            try:
                yield hold
            finally:
                hold.end()

    def record(self, section: str, wall: float, cpu: float) -> None:
        self.holds[section] = self.holds.get(section, 0) + 1
        if wall > self.max_s.get(section, 0.0):
            self.max_s[section] = wall
        if cpu > self.cpu_max_s.get(section, 0.0):
            self.cpu_max_s[section] = cpu
