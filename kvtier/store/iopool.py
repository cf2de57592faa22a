"""A lower tier's I/O threads, with a bound on how long any job may take.

Python cannot interrupt a thread stuck in a system call (a hung NFS mount, an S3 endpoint
that stopped answering), so the bound is enforced around the job, not inside it::

    queued ──worker──► running ──► done
      │                   └── running past timeout_s: flagged late once (the store fails
      │                       the job's waiters now; the job's own ending still runs if it
      │                       ever returns) and a spare worker takes its place
      └── queued past timeout_s: abandoned, never runs

Workers are daemon threads, so a job that never returns does not keep the process alive,
and at most ``2 x threads`` workers ever exist however many jobs hang. ``overdue()`` only
marks and returns jobs; the caller applies the consequences under its own lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("kvtier.store")


class Job:
    __slots__ = ("abandoned", "done", "fn", "late", "on_abandon", "on_late", "started",
                 "submitted")

    def __init__(self, fn: Callable[[Job], None], on_abandon: Callable[[], None] | None,
                 on_late: Callable[[], None] | None, now: float) -> None:
        self.fn = fn
        self.on_abandon = on_abandon
        self.on_late = on_late
        self.submitted = now
        self.started: float | None = None
        self.late = False
        self.abandoned = False
        self.done = False


class IOPool:
    def __init__(self, name: str, threads: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.threads = threads
        self.timeout_s = timeout_s
        self.clock = clock
        self._queue: deque[Job] = deque()
        self._running: set[Job] = set()
        self._cond = threading.Condition()
        self._workers = 0
        self._stuck = 0
        self._closed = False
        for _ in range(threads):
            self._spawn()

    def submit(self, fn: Callable[[Job], None], *, on_abandon: Callable[[], None] | None = None,
               on_late: Callable[[], None] | None = None) -> Job:
        """Queue ``fn(job)``. Raises RuntimeError after :meth:`close`."""
        job = Job(fn, on_abandon, on_late, self.clock())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"I/O pool {self.name} is closed")
            self._queue.append(job)
            self._cond.notify()
        return job

    @property
    def pending(self) -> int:
        """Jobs queued or running (running late ones included)."""
        with self._cond:
            return len(self._queue) + len(self._running)

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def overdue(self) -> tuple[list[Job], list[Job]]:
        """(queued jobs now abandoned, running jobs now late): each job is returned once."""
        now = self.clock()
        with self._cond:
            abandoned = [j for j in self._queue if now - j.submitted > self.timeout_s]
            for job in abandoned:
                self._queue.remove(job)
                job.abandoned = True
            late = [j for j in self._running if not j.late and j.started is not None
                    and now - j.started > self.timeout_s]
            for job in late:
                job.late = True
                self._stuck += 1
                if self._workers - self._stuck < self.threads and self._workers < 2 * self.threads:
                    self._spawn()
            if abandoned or late:
                self._cond.notify_all()
        return abandoned, late

    def drain(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or running (late jobs aside). True if drained."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or any(not j.late for j in self._running):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, wait_s: float = 10.0) -> bool:
        """Finish queued jobs (up to ``wait_s``), then stop the workers. True if drained."""
        drained = self.drain(wait_s)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        return drained

    def _spawn(self) -> None:
        self._workers += 1
        thread = threading.Thread(target=self._work, daemon=True,
                                  name=f"kvtier-{self.name}-{self._workers}")
        thread.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._workers -= 1
                    return
                job = self._queue.popleft()
                job.started = self.clock()
                self._running.add(job)
            try:
                job.fn(job)
            except Exception:  # the job handles its own errors; this is a bug
                log.exception("I/O job on %s failed", self.name)
            with self._cond:
                self._running.discard(job)
                job.done = True
                if job.late:
                    self._stuck -= 1
                    if self._workers > self.threads:  # its replacement took over
                        self._workers -= 1
                        self._cond.notify_all()
                        return
                self._cond.notify_all()
