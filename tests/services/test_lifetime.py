"""No service outlives the process that started it, and what a killed run left is swept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvtier.ports import free_ports, port_free
from kvtier.processes import alive
from kvtier.services import SeaweedFS
from kvtier.services.lifetime import PORTS_FILE, PREFIX, sweep_stale
from kvtier.services.mounts import is_mounted

pytestmark = pytest.mark.services

# Starts a mount and a redis-server, reports them, then either exits (atexit must clean up)
# or waits to be SIGKILLed (the kernel must kill the children; the sweep cleans the rest).
CHILD = """
import json, sys, time
from kvtier.services import RedisServer, SeaweedMount
mount = SeaweedMount(sys.argv[1]).start()
redis = RedisServer().start()
print(json.dumps({"pids": [mount.pid, redis.pid], "mount": str(mount.path),
                  "dirs": [str(mount.workdir), str(redis.workdir)]}), flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def run_child(filer: str, mode: str) -> tuple[subprocess.Popen[str], dict[str, object]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.Popen([sys.executable, "-c", CHILD, filer, mode], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def wait_gone(pids: list[int], timeout_s: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_a_normal_exit_closes_every_service(seaweedfs: SeaweedFS) -> None:
    child, info = run_child(seaweedfs.filer_address, "exit")
    assert child.wait(60) == 0
    assert wait_gone(info["pids"]) == []  # type: ignore[arg-type]
    assert not is_mounted(Path(str(info["mount"])))
    assert not any(Path(d).exists() for d in info["dirs"])  # type: ignore[attr-defined]


def test_a_killed_parent_takes_its_services_along_and_the_sweep_cleans_up(
        seaweedfs: SeaweedFS) -> None:
    child, info = run_child(seaweedfs.filer_address, "wait")
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert wait_gone(info["pids"]) == [], "pdeathsig: the kernel kills the children"
    mount = Path(str(info["mount"]))
    assert is_mounted(mount), "a killed weed mount leaves its mount behind"
    swept = sweep_stale()
    assert not is_mounted(mount)
    assert {str(p) for p in swept} >= set(info["dirs"])  # type: ignore[arg-type]
    assert not any(Path(d).exists() for d in info["dirs"])  # type: ignore[attr-defined]


def test_the_sweep_removes_weed_sockets_of_dead_owners_only() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = Path(tempfile.gettempdir())
    stale = Path(tempfile.mkdtemp(prefix=f"{PREFIX}seaweedfs-{dead.pid}-"))
    live = Path(tempfile.mkdtemp(prefix=f"{PREFIX}seaweedfs-{os.getpid()}-"))
    port = free_ports(1)[0]
    (stale / PORTS_FILE).write_text(str(port))
    sock = Path("/tmp") / f"seaweedfs-filer-grpc-{port}.sock"
    sock.touch()
    try:
        sweep_stale()
        assert not stale.exists() and not sock.exists()
        assert live.exists() and tmp.exists()
    finally:
        sock.unlink(missing_ok=True)
        live.rmdir()


def test_picked_ports_are_free_distinct_loopback_and_never_repeated() -> None:
    first, second = free_ports(10), free_ports(10)
    assert len(set(first + second)) == 20
    assert all(20000 <= p < 32768 and port_free(p) for p in first + second)
