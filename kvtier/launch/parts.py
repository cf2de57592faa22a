"""The kinds of part the stack supervises (:mod:`kvtier.launch.supervise`).

- :class:`ProcessPart`: a child process with a log file and an HTTP probe — an instance
  (``kvtier serve``: its node server in the process, vLLM in a session of its own) or the
  router. Killing it kills its own process group and the groups its children started
  (vLLM's API server and EngineCore), noted while it ran, so a node server killed with
  SIGKILL leaves no vLLM holding the instance's port.
- :class:`ServicePart`: a local SeaweedFS or redis-server (:mod:`kvtier.services`), restarted
  on its ports with its data kept.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.httpjson import http_status
from kvtier.processes import Child, child_groups, kill_groups
from kvtier.services.base import Service

PROBE_TIMEOUT_S = 2.0


@dataclass
class ProcessPart:
    name: str
    argv: Sequence[str]
    log_path: Path
    probe_url: str
    """``GET`` here tells whether it serves."""
    only_200: bool = True
    """True: only a 200 counts (vLLM's /health is 503 once its engine died); False: any
    HTTP answer does (a router's /health is 503 while no backend is up, yet it serves)."""
    env: Mapping[str, str] | None = None
    cpus: frozenset[int] | None = None
    """The only CPUs it may run on (None: any this process may)."""
    child: Child | None = None
    groups: set[int] = field(default_factory=set)

    def launch(self) -> None:
        self.groups = set()
        self.child = Child.start(  # the log is kept across restarts
            self.name, self.argv, self.log_path, env=self.env, cpus=self.cpus,
            header=f"--- {time.strftime('%H:%M:%S')} kvtier serve starts {self.name}\n")

    def running(self) -> bool:
        return self.child is not None and self.child.running

    def answers(self) -> bool:
        status = http_status(self.probe_url, timeout_s=PROBE_TIMEOUT_S)
        return status == 200 if self.only_200 else status is not None

    def exit_status(self) -> int | None:
        return self.child.returncode() if self.child is not None else None

    def observe(self) -> None:
        if self.child is not None and self.child.running:
            self.groups |= child_groups(self.child.pid)

    def kill(self) -> None:
        if self.child is None:
            return
        self.observe()
        self.child.signal_group(signal.SIGKILL)  # at once with the groups it started
        kill_groups(self.groups)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.child.kill()

    def stop(self, timeout_s: float) -> None:
        if self.child is None:
            return
        self.observe()
        self.child.stop(timeout_s)
        kill_groups(self.groups)  # what it should have stopped and did not

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    @property
    def log(self) -> Path | None:
        return self.log_path

    def tail(self, lines: int = 15) -> str:
        return self.child.tail(lines) if self.child is not None else ""


@dataclass
class ServicePart:
    name: str
    service: Service

    def launch(self) -> None:
        self.service.start()  # blocks until it answers (its start_timeout_s) or raises

    def running(self) -> bool:
        return self.service.running

    def answers(self) -> bool:
        return self.service.answers()

    def exit_status(self) -> int | None:
        return self.service.exit_status()

    def observe(self) -> None:
        return None

    def kill(self) -> None:
        self.service.kill()
        self.service.stop()  # reaps it and removes what it left (sockets)

    def stop(self, timeout_s: float) -> None:
        self.service.stop()

    @property
    def pid(self) -> int | None:
        return self.service.pid

    @property
    def log(self) -> Path | None:
        return self.service.log_path

    def tail(self, lines: int = 15) -> str:
        return self.service.log_tail(lines)


def stop_together(parts: Sequence[ProcessPart], timeout_s: float) -> None:
    """Stop ``parts`` at once: all asked (SIGTERM), then each waited for until one shared
    deadline, then whatever is left of each killed."""
    for part in parts:
        part.observe()
        if part.child is not None:
            part.child.terminate()
    deadline = time.monotonic() + timeout_s
    for part in parts:
        if part.child is not None:
            part.child.wait_stopped(deadline)
        kill_groups(part.groups)
