"""What every local service shares: start with a timeout, stop, restart, pause, close.

A service owns one child process at a time, a working folder and (for network services) a set
of ports. ``start`` waits until the service answers; when the child dies because a port was
taken meanwhile, it draws new ports and tries again (only before the first successful start:
after that the ports are the service's address and ``restart`` keeps them).

States, as tests drive them to simulate outages::

    new ──start──► running ──stop──► stopped ──start──► running      (data kept)
                     │  ▲                                  ...
               pause │  │ resume       kill: SIGKILL, as a crash       close: stop + remove folder
                     ▼  │
                   paused (holds its ports, answers nothing: a hung server)
"""

from __future__ import annotations

import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

from kvtier.errors import ServiceError, ServiceStartError
from kvtier.processes import Child, wait_ready
from kvtier.services.lifetime import make_workdir, remove_workdir, track, untrack

_BIND_FAILURE = "address already in use"


class Service(ABC):
    """Base of SeaweedFS, SeaweedMount and RedisServer."""

    kind: str = "service"
    start_attempts: int = 3

    def __init__(self, *, workdir: Path | None, start_timeout_s: float, stop_timeout_s: float,
                 die_with_parent: bool) -> None:
        self._own_workdir = workdir is None
        self.workdir = make_workdir(self.kind) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent
        self._process: Child | None = None
        self._started_once = False
        self._closed = False

    # -- what a subclass supplies -------------------------------------------------------------

    @abstractmethod
    def _command(self) -> list[str]:
        """The argv of the child (the binary is looked up here, so a missing one raises)."""

    def _environment(self) -> Mapping[str, str] | None:
        return None

    @abstractmethod
    def _answers(self) -> bool:
        """One quick probe (well under a second): does the service serve requests yet?"""

    @abstractmethod
    def _where(self) -> str:
        """Its address (ports, mount point) for messages."""

    def _new_ports(self) -> bool:
        """Draw fresh ports after a bind failure; False when the ports are fixed."""
        return False

    def _before_start(self) -> None:
        """Checks and preparation before each start (e.g. FUSE available, folders made)."""
        return None

    def _after_stop(self) -> None:
        """Cleanup after the child exited (sockets, mounts)."""
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.running

    def start(self) -> Self:
        """Start the child and wait until it answers; raises ServiceStartError after
        ``start_timeout_s`` (with the command, the address and the last log lines)."""
        if self._closed:
            raise ServiceError(f"{self.kind} at {self._where()} is closed")
        if self.running:
            return self
        self._before_start()
        track(self)
        for attempt in range(1, self.start_attempts + 1):
            process = self._spawn()
            try:
                self._wait_until_answering(process)
            except _PortTaken:
                process.stop(self.stop_timeout_s, leader_first=False)
                self._after_stop()
                if self._started_once or attempt == self.start_attempts or not self._new_ports():
                    raise ServiceStartError(
                        f"{self.kind}: a port is taken ({self._where()}); "
                        f"{_describe(process)}") from None
                continue
            self._started_once = True
            return self
        raise AssertionError("unreachable")

    def answers(self) -> bool:
        """One quick probe: does it serve requests now? (A paused one does not.)"""
        return self.running and self._answers()

    def exit_status(self) -> int | None:
        """The last child's exit status (None: running, or never started)."""
        return self._process.returncode() if self._process is not None else None

    @property
    def log_path(self) -> Path | None:
        return self._process.log if self._process is not None else None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; keeps the data for a later start."""
        if self._process is not None:
            self._process.stop(self.stop_timeout_s, leader_first=False)
        self._after_stop()

    def restart(self) -> Self:
        self.stop()
        return self.start()

    def kill(self) -> None:
        """SIGKILL, no cleanup by the service itself: what clients see when it crashes."""
        if self._process is not None:
            self._process.kill()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung server)."""
        if self._process is not None:
            self._process.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            self._process.signal_group(signal.SIGCONT)

    def close(self) -> None:
        """Stop and remove the working folder (when this service made it)."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            untrack(self)
            if self._own_workdir:
                remove_workdir(self.workdir)

    def log_tail(self, lines: int = 20) -> str:
        return self._process.tail(lines) if self._process is not None else "(not started)"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} {self._where()} {state} pid={self.pid}>"

    # -- internals ----------------------------------------------------------------------------

    def _spawn(self) -> Child:
        argv = self._command()
        try:
            process = Child.start(
                self.kind, argv, self.workdir / f"{self.kind}.log", env=self._environment(),
                cwd=self.workdir, header=f"--- {time.strftime('%H:%M:%S')} start {self.kind}\n",
                death_signal=signal.SIGKILL if self.die_with_parent else None)
        except OSError as exc:
            raise ServiceStartError(f"{self.kind}: cannot run {argv[0]}: {exc}") from exc
        self._process = process
        return process

    def _wait_until_answering(self, process: Child) -> None:
        if wait_ready(self._answers, timeout_s=self.start_timeout_s,
                      alive=lambda: process.running, every_s=0.05):
            return
        if not process.running:
            if _bind_failed(process.output()):
                raise _PortTaken
            self._after_stop()
            raise ServiceStartError(
                f"{self.kind} at {self._where()} exited while starting; {_describe(process)}")
        process.stop(self.stop_timeout_s, leader_first=False)
        self._after_stop()
        raise ServiceStartError(
            f"{self.kind} at {self._where()} did not answer within "
            f"{self.start_timeout_s:g} s; {_describe(process)}")


class _PortTaken(Exception):
    pass


def _bind_failed(log: str) -> bool:
    return _BIND_FAILURE in log.lower()


def _describe(process: Child) -> str:
    """Command line and log tail, for error messages (never the environment)."""
    status = process.returncode()
    state = "running" if status is None else f"exited with status {status}"
    return (f"{process.name} ({' '.join(process.argv)}) {state}; log {process.log}, last lines:\n"
            f"{process.tail()}")
