"""Running ``kvtier serve --instances N`` as a test would: in its own process, its terminal
output captured in a file, stopped with SIGINT (a Ctrl-C) by its process id."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.ports import ephemeral_range

ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "10240",
               "--num-gpu-blocks-override", "96", "--arena-size", "256MiB"]


def free_base(n: int) -> int:
    """A port P with P..P+n and P+101..P+100+n free on loopback, all below the kernel's
    ephemeral range: a restarted part must not find its port held by an outgoing
    connection's TIME_WAIT (kvtier.ports)."""
    top = min(40000, ephemeral_range()[0]) - 200
    for _ in range(200):
        base = random.randrange(20000, top)
        ports = [base + i for i in range(n + 1)] + [base + 101 + i for i in range(n)]
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


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
    port = free_base(instances)
    run_dir = root / "run"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--instances", str(instances),
           "--port", str(port), "--run-dir", str(run_dir), *args, *ENGINE_ARGS]
    terminal = root / "terminal.txt"
    with open(terminal, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    return RunningStack(proc, port, run_dir, terminal)
