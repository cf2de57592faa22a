"""Stopping a stack stops its whole process group, also when the leader has already exited:
a real process tree (a Python parent that starts a sleeping child and exits), as vLLM's API
server leaves its EngineCore behind when it dies."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.bench import stacks
from kvtier.bench.stacks import ProcSpec, StackEnv, free_port, launch
from kvtier.processes import Child, alive, group_members, stop_group

# the parent starts a child in its own group and exits at once; the child sleeps on
_ORPHANING = """
import signal, subprocess, sys
ignore = sys.argv[1] == "ignore-term"
pre = (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if ignore else None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=pre)
open(sys.argv[2], "w").write(str(child.pid))
sys.exit(3)
"""


def _orphaning(tmp_path: Path, mode: str = "plain") -> list[str]:
    return [sys.executable, "-c", _ORPHANING, mode, str(tmp_path / "child.pid")]


def _leader_gone_child_left(tmp_path: Path, mode: str = "plain") -> subprocess.Popen[bytes]:
    popen = subprocess.Popen(_orphaning(tmp_path, mode), start_new_session=True)
    popen.wait(timeout=30)
    assert popen.returncode == 3
    assert len(group_members(popen.pid)) == 1, "the child outlived its parent"
    return popen


def test_stop_group_stops_the_orphans_of_a_leader_that_exited(tmp_path: Path) -> None:
    popen = _leader_gone_child_left(tmp_path)
    started = time.monotonic()
    assert stop_group(popen, 10.0) == 3
    assert group_members(popen.pid) == []
    assert time.monotonic() - started < 5, "SIGTERM was enough"


def test_an_orphan_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    popen = _leader_gone_child_left(tmp_path, "ignore-term")
    started = time.monotonic()
    stop_group(popen, 1.0)
    assert group_members(popen.pid) == []
    assert time.monotonic() - started >= 1.0, "SIGKILL only after the grace period"


def test_a_stack_that_exits_before_it_is_ready_leaves_no_process(tmp_path: Path) -> None:
    env = StackEnv(model="m", served_name="m", engine_args=(), workdir=tmp_path / "w",
                   stop_timeout_s=10.0)
    port = free_port()
    spec = ProcSpec("engine", _orphaning(tmp_path),
                    stacks.http_ready(f"http://127.0.0.1:{port}"))
    with pytest.raises(stacks.StackError, match="exited with status 3"):
        launch(env, [spec], port)
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < deadline, "the orphaned child is still running"
        time.sleep(0.05)


def test_stopping_a_stack_whose_leader_died_stops_its_children(tmp_path: Path) -> None:
    popen = _leader_gone_child_left(tmp_path)
    stack = stacks.StartedConfig("http://127.0.0.1:1", [Child("engine", popen, tmp_path / "log")],
                                 10.0)
    assert not stack.alive()
    stack.stop()
    assert group_members(popen.pid) == []


def test_kvtier_serve_stops_what_vllm_left_when_it_died_before_ready(tmp_path: Path) -> None:
    import signal
    from types import SimpleNamespace

    from kvtier.launch import serve_one

    plan = SimpleNamespace(cmd=_orphaning(tmp_path), log_file=None, model="m",
                           base_url=f"http://127.0.0.1:{free_port()}")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = serve_one._run_vllm(plan, False, None, None)  # type: ignore[arg-type]
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert rc == 1, "vLLM did not come up"
    child = int((tmp_path / "child.pid").read_text())
    assert not alive(child), "its orphan was stopped with its group"
