"""The processes ``kvtier serve`` starts: each logging to a file, stopped by its process id.

A :class:`Child` runs in a process group of its own (a new session), so a Ctrl-C on the
terminal reaches only ``kvtier serve``, which stops its children in order; each child also
gets SIGTERM if ``kvtier serve`` itself dies (``PR_SET_PDEATHSIG``). Stopping sends SIGTERM to
the child (which stops what it started: vLLM's API server stops its EngineCore), waits, and
then SIGKILLs whatever is left in the group it was started in — never anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.groups import group_members

__all__ = ["Child", "die_with_parent", "group_members", "stop_all"]

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: SIGTERM this child when the process that started it dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, name: str, argv: Sequence[str], log: Path,
              env: Mapping[str, str] | None = None) -> Child:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(env or os.environ),
                                     start_new_session=True, preexec_fn=die_with_parent)
        return cls(name, popen, log)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        """Ask the child to stop (SIGTERM to its process id)."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> int:
        """Wait for the child until ``deadline`` (monotonic), SIGKILL its group if it is
        still there, and reap anything left in the group; returns its exit status."""
        try:
            self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.popen.wait(timeout=30)
        self._kill_group()  # what the child started and left behind (its group is ours)
        return self.popen.returncode

    def stop(self, timeout_s: float = 60.0) -> int:
        self.terminate()
        return self.wait_stopped(time.monotonic() + timeout_s)

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def tail(self, lines: int = 20) -> str:
        try:
            data = self.log.read_bytes()[-64 * 1024:]
        except OSError:
            return "(no log)"
        return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def stop_all(children: Sequence[Child], timeout_s: float = 60.0) -> None:
    """Stop ``children`` together: all asked at once, then each waited for."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        child.wait_stopped(deadline)
