"""One child process of a service: started in its own process group, stopped by its id.

Three things keep a service from outliving the Python process that started it:

- ``setpriv --pdeathsig KILL`` (util-linux) asks the kernel to kill the child when the thread
  that started it ends, even when Python itself is killed with SIGKILL. Start services from a
  thread that lives as long as they should (the main thread), or pass ``die_with_parent=False``.
- Every live service is closed by an ``atexit`` hook (``kvtier.services.lifetime``).
- The child leads its own process group, so a stop signals everything it may have spawned, and
  a Ctrl-C in the terminal reaches only the Python process, which then stops it in order.

Output (stdout and stderr) goes to a log file whose last lines go into every error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.errors import ServiceStartError


class ManagedProcess:
    """A command run with a log file; ``stop`` is SIGTERM, then SIGKILL after a timeout."""

    def __init__(self, name: str, argv: Sequence[str], *, log_path: Path, cwd: Path,
                 env: Mapping[str, str] | None = None, die_with_parent: bool = True) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self.die_with_parent = die_with_parent
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def spawn(self) -> None:
        if self.running:
            raise ServiceStartError(f"{self.name} is already running (pid {self.pid})")
        argv = self.argv
        setpriv = shutil.which("setpriv") if self.die_with_parent else None
        if setpriv:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            log.write(f"--- {time.strftime('%H:%M:%S')} start {self.name}\n".encode())
            log.flush()
            try:
                self._popen = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd=self.cwd, env=self.env, start_new_session=True)
            except OSError as exc:
                raise ServiceStartError(f"{self.name}: cannot run {argv[0]}: {exc}") from exc

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the group, SIGKILL it after ``timeout_s``; the exit status (None: never ran).

        A paused process gets SIGCONT after the SIGTERM, so the SIGTERM is not left pending.
        """
        if self._popen is None:
            return None
        if self._popen.poll() is None:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)
            try:
                self._popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self._popen.returncode

    def kill(self) -> None:
        """SIGKILL the group at once (a crash, as far as clients can tell)."""
        if self._popen is None:
            return
        self._signal(signal.SIGKILL)
        self._popen.wait()

    def pause(self) -> None:
        """SIGSTOP: the process stays, holds its ports and answers nothing (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        # Only while the child is unreaped: until then its pid (= its group id) cannot be reused.
        if self._popen is None or self._popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._popen.pid, sig)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as log:
                tail = deque(log, maxlen=lines)
        except OSError:
            return "(no log)"
        return b"".join(tail).decode(errors="replace").rstrip()

    def log_since_start(self) -> str:
        """Everything the current (or last) run wrote to the log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def describe(self) -> str:
        """Command line and log tail, for error messages (never the environment)."""
        status = self.returncode()
        state = "running" if status is None else f"exited with status {status}"
        return (f"{self.name} ({' '.join(self.argv)}) {state}; log {self.log_path}, last lines:\n"
                f"{self.log_tail()}")
