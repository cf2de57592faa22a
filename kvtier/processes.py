"""The processes kvtier starts and the process groups they lead: the one place for them.

Every child (``kvtier serve``'s vLLM and its parts, the local services, the benchmarks'
stacks) is started by :func:`spawn` in a session of its own, so it leads a process group that
also holds what it starts (vLLM's API server and its EngineCore), and a Ctrl-C on the
terminal reaches only kvtier, which stops its children in order. Each child also gets a
signal from the kernel when the thread that started it ends (``PR_SET_PDEATHSIG``), even
when kvtier itself is SIGKILLed: start children from a thread that lives as long as they
should (the main thread).

Stopping (:func:`stop_group`) signals the group whether or not its leader is still alive
(a crashed leader's orphans are still in it), waits up to a grace period, SIGKILLs what is
left and waits until the group is empty. Only groups this process started are signalled,
by their id. A zombie is not a member and not :func:`alive`: it is dead, only not yet
reaped (an orphan's zombie waits for init), and waiting for it to go could take forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

import psutil

POLL_S = 0.05
KILL_WAIT_S = 30.0
"""How long a SIGKILLed group may take to be gone (it cannot refuse; a call stuck in the
kernel, as on a dead FUSE mount, can delay it)."""
TAIL_BYTES = 64 * 1024

_GONE = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
_PR_SET_PDEATHSIG = 1
T = TypeVar("T")


# ---------------------------------------------------------------- who is alive, who is in a group


def alive(pid: int) -> bool:
    """True if ``pid`` names a live process (also one of another user); a zombie is dead.
    Never signals it."""
    if pid <= 0:
        return False  # 0 and negatives name process groups, not a process
    try:
        return psutil.Process(pid).status() not in _GONE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (zombies are not members)."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(proc.pid) == pgid and proc.status() not in _GONE:
                members.append(proc.pid)
    return members


def child_groups(pid: int) -> set[int]:
    """Process groups led by children of ``pid`` that left its group (a child started in a
    session of its own, as ``kvtier serve`` starts vLLM): what to stop besides ``pid``'s own
    group, noted while ``pid`` lives (once it dies, its children are no longer its)."""
    groups = set()
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children():
            with contextlib.suppress(OSError):
                group = os.getpgid(child.pid)
                if group != pid:
                    groups.add(group)
    return groups


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for group ``pgid`` to have no live member; True if none."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


# ---------------------------------------------------------------- starting


def spawn(argv: Sequence[str], *, out: IO[bytes] | IO[str] | None = None,
          env: Mapping[str, str] | None = None, cwd: Path | None = None,
          death_signal: int | None = signal.SIGTERM,
          cpus: Collection[int] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session (and process group) of its own, stdin from /dev/null,
    stdout and stderr to ``out`` (None: this process's). ``death_signal``: what the kernel
    sends it when the thread that started it ends (None: nothing). ``cpus``: the only CPUs
    it and what it starts may run on, set before it runs (None: this process's). Raises
    OSError when ``argv[0]`` cannot be run, ValueError when ``cpus`` is empty."""
    if cpus is not None and not cpus:
        raise ValueError("cpus: give at least one CPU, or None for this process's")
    return subprocess.Popen(
        list(argv), stdin=subprocess.DEVNULL, stdout=out,
        stderr=subprocess.STDOUT if out is not None else None,
        env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
        preexec_fn=_before_exec(death_signal, cpus) if death_signal or cpus else None)


def _before_exec(sig: int | None, cpus: Collection[int] | None) -> Callable[[], None]:
    """A ``preexec_fn``: bind the child to ``cpus``, and ask the kernel for ``sig`` when the
    parent dies (if the parent died before the request was made, the child signals itself
    at once)."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # looked up before the fork, not in the child
    mask = frozenset(cpus) if cpus else None

    def before_exec() -> None:
        if mask is not None:
            os.sched_setaffinity(0, mask)  # an error here fails the start, naming it
        if sig:
            with contextlib.suppress(OSError, AttributeError):
                libc.prctl(_PR_SET_PDEATHSIG, sig)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
    return before_exec


# ---------------------------------------------------------------- stopping


def signal_group(popen: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the group ``popen`` leads, while its id is still that group's: the
    leader is unreaped, or members are left (a group id is not reused while it has any)."""
    if popen.poll() is not None and not group_members(popen.pid):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


def stop_group(popen: subprocess.Popen[bytes], timeout_s: float,
               leader_first: bool = False) -> int:
    """Stop the group ``popen`` leads (it must have been started by :func:`spawn`): SIGTERM
    (and SIGCONT, so a paused member does not keep it pending), up to ``timeout_s`` for the
    leader and every member to go, then SIGKILL to what is left. Works when the leader has
    already exited (its orphans are still in the group).

    ``leader_first``: SIGTERM only the leader, which stops what it started (a clean vLLM
    shutdown), and the group only once the leader is gone. Returns the leader's status."""
    deadline = time.monotonic() + timeout_s
    if leader_first and popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signal.SIGTERM)
        _wait_leader(popen, deadline)
    signal_group(popen, signal.SIGTERM)
    signal_group(popen, signal.SIGCONT)
    _wait_leader(popen, deadline)
    while group_members(popen.pid) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return kill_group(popen)


def kill_group(popen: subprocess.Popen[bytes]) -> int:
    """SIGKILL the group ``popen`` leads, reap the leader and wait until the group is empty;
    returns the leader's status."""
    signal_group(popen, signal.SIGKILL)
    popen.wait(timeout=KILL_WAIT_S)
    wait_group_gone(popen.pid, KILL_WAIT_S)
    return popen.returncode


def kill_groups(pgids: Iterable[int], timeout_s: float = KILL_WAIT_S) -> None:
    """SIGKILL process groups noted by :func:`child_groups` (led by what a child started, not
    by a child of this process) and wait up to ``timeout_s`` until they are empty. Only
    groups that still have members are signalled: an empty group's id may be reused."""
    live = [pgid for pgid in pgids if group_members(pgid)]
    for pgid in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for pgid in live:
        wait_group_gone(pgid, max(0.0, deadline - time.monotonic()))


def _wait_leader(popen: subprocess.Popen[bytes], deadline: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------- readiness, logs


def wait_ready(probe: Callable[[], T], *, timeout_s: float,
               alive: Callable[[], bool] = lambda: True, every_s: float = 0.5) -> T | None:
    """Call ``probe`` every ``every_s`` until it returns something truthy, and return that;
    None once ``alive()`` turns false (the process it waits for exited) or after
    ``timeout_s``. The caller tells the two apart by asking ``alive()`` again."""
    deadline = time.monotonic() + timeout_s
    while alive():
        answer = probe()
        if answer:
            return answer
        if time.monotonic() > deadline:
            return None
        time.sleep(every_s)
    return None


def log_tail(path: Path, lines: int = 20, max_bytes: int = TAIL_BYTES) -> str:
    """The last ``lines`` lines of the log at ``path`` (within its last ``max_bytes``), for
    error messages; ``(no log)`` when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
            data = log.read()
    except OSError:
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------- a child with a log file


@dataclass
class Child:
    """A process started by :func:`spawn` with its output appended to a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    log_start: int = 0
    """Where this run's output begins in the log (a log is kept across restarts)."""
    argv: tuple[str, ...] = ()

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log: Path, *,
              env: Mapping[str, str] | None = None, cwd: Path | None = None,
              death_signal: int | None = signal.SIGTERM, header: str = "",
              cpus: Collection[int] | None = None) -> Child:
        """Start ``argv`` (:func:`spawn`); ``header`` is written to the log first (a line
        saying who starts)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            start = out.tell()
            if header:
                out.write(header.encode())
                out.flush()
            popen = spawn(argv, out=out, env=env if env is not None else os.environ,
                          cwd=cwd, death_signal=death_signal, cpus=cpus)
        return cls(name, popen, log, start, tuple(argv))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def returncode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its process id, not its group)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> int:
        """Wait for the child until ``deadline`` (monotonic), then SIGKILL what is left in
        its group, whether the child exited or not; returns its exit status."""
        _wait_leader(self.popen, deadline)
        return kill_group(self.popen)

    def stop(self, timeout_s: float, leader_first: bool = True) -> int:
        """:func:`stop_group` of the child's group."""
        return stop_group(self.popen, timeout_s, leader_first=leader_first)

    def kill(self) -> int:
        """SIGKILL the group at once (a crash, as far as clients can tell)."""
        return kill_group(self.popen)

    def signal_group(self, sig: int) -> None:
        signal_group(self.popen, sig)

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)

    def output(self) -> str:
        """Everything this run wrote to the log."""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""


def stop_all(children: Sequence[Child], timeout_s: float = 60.0) -> None:
    """Stop ``children`` together: all asked at once, then each waited for until one shared
    deadline, then what is left of each killed."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.wait_stopped(deadline)


class StopRequest:
    """SIGINT / SIGTERM asking a supervising loop to stop, safe to receive at any moment.

    The handler only sets a flag: a handler that takes a lock (``threading.Event.set``) can
    deadlock when the signal lands while the main thread holds that lock, e.g. inside
    ``Event.wait`` reacquiring it (seen: ``kvtier serve`` stuck for good after two SIGTERMs).
    Use as a context manager; the previous handlers come back on exit."""

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = tuple(signals)
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, _signum: int, _frame: object) -> None:
        self.requested = True

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less once a stop is requested; whether one was."""
        deadline = time.monotonic() + seconds
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, POLL_S))
        return self.requested

    def __enter__(self) -> StopRequest:
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
