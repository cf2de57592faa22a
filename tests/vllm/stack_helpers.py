"""Running ``kvtier serve --instances N`` as a test would: in its own process, its terminal
output captured in a file, stopped with SIGINT (a Ctrl-C) by its process id."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.ports import free_base

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "10240",
               "--num-gpu-blocks-override", "96", "--arena-size", "256MiB"]


@dataclass
class RunningStack:
    proc: subprocess.Popen[bytes]
    port: int
    run_dir: Path
    terminal: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def state(self) -> dict[str, Any]:
        return dict(json.loads((self.run_dir / "stack.json").read_text()))

    def output(self) -> str:
        return self.terminal.read_text(errors="replace")

    def wait_up(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ctrl-C stops everything" not in self.output():
            assert self.proc.poll() is None, f"the stack exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"the stack is not up:\n{self.output()}"
            time.sleep(0.5)

    def interrupt(self, timeout_s: float = 180.0) -> int:
        """Ctrl-C: SIGINT to the stack's process, and its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_stack(root: Path, *args: str, instances: int = 2) -> RunningStack:
    # the router on P, the instances on P+1.., their node servers on P+101..
    port = free_base([*range(instances + 1), *range(101, 101 + instances)])
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--instances", str(instances),
           "--port", str(port), "--run-dir", str(run_dir), *args, *ENGINE_ARGS]
    terminal = root / "terminal.txt"
    with open(terminal, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return RunningStack(proc, port, run_dir, terminal)
