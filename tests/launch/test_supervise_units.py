"""The stack's supervisor with real processes, no vLLM: a part that exits is restarted alone
with backoff and its log kept; a part that stops answering (SIGSTOP) is killed and restarted;
a part that crashes on every start is given up after the bound; ``--restart never`` gives up
at once; killing a part also kills the process groups its children started in sessions of
their own (vLLM under ``kvtier serve``), also after the part itself died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_helpers import options

from kvtier.errors import ConfigError
from kvtier.launch.parts import ProcessPart
from kvtier.launch.supervise import PartState, RestartPolicy, Supervised, Supervisor
from kvtier.ports import free_port
from kvtier.processes import alive, group_members

FAST = RestartPolicy(limit=2, window_s=60, backoff_s=0.1, backoff_max_s=0.4,
                     probe_every_s=0.2, unanswered=2, start_timeout_s=30)


def http_part(tmp_path: Path, name: str = "web") -> ProcessPart:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    return ProcessPart(name, argv, tmp_path / f"{name}.log",
                       f"http://127.0.0.1:{port}/health", only_200=False)


def crashing_part(tmp_path: Path) -> ProcessPart:
    argv = [sys.executable, "-c", "import sys; print('bad flag: --no-such'); sys.exit(3)"]
    return ProcessPart("broken", argv, tmp_path / "broken.log", "http://127.0.0.1:9/health")


def run_until(sup: Supervisor, done: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the supervisor never got there"
        sup.tick()
        time.sleep(0.05)


@pytest.fixture
def lines() -> list[str]:
    return []


@pytest.fixture
def supervisor(lines: list[str]) -> Iterator[Supervisor]:
    changes: list[Supervised] = []
    sup = Supervisor(FAST, lines.append, changes.append)
    yield sup
    for record in sup:
        record.part.kill()
    sup.close()


def test_a_part_that_exits_is_restarted_alone_and_its_log_kept(
        tmp_path: Path, supervisor: Supervisor, lines: list[str]) -> None:
    web, other = http_part(tmp_path, "web"), http_part(tmp_path, "other")
    a, b = supervisor.add(web), supervisor.add(other)
    run_until(supervisor, lambda: a.state is b.state is PartState.UP)
    first, other_pid = web.pid, other.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    run_until(supervisor, lambda: a.state is PartState.RESTARTING)
    run_until(supervisor, lambda: a.state is PartState.UP)
    assert web.pid != first and a.restarts == 1 and b.restarts == 0
    assert other.pid == other_pid and other.running(), "the rest was left alone"
    said = [line for line in lines if line.startswith("kvtier serve: web")]
    assert said[-3].startswith("kvtier serve: web exited (status 137); restarting it in 0 s "
                               "(restart 1 of 2 within 60 s)"), said
    assert said[-2] == "kvtier serve: web starting (restart 1)"
    assert said[-1].startswith("kvtier serve: web up again after restart 1"), said
    assert web.log_path.read_text().count("kvtier serve starts web") == 2, "log kept"
    assert a.as_dict()["state"] == "up" and a.as_dict()["restarts"] == 1
    assert a.summary() == "web up (1 restart)"


def test_a_part_that_stops_answering_is_killed_and_restarted(
        tmp_path: Path, supervisor: Supervisor, lines: list[str]) -> None:
    web = http_part(tmp_path)
    record = supervisor.add(web)
    run_until(supervisor, lambda: record.state is PartState.UP)
    hung = web.pid
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)
    run_until(supervisor, lambda: record.state is PartState.RESTARTING)
    assert "stopped answering (2 probes in a row)" in record.reason
    assert not alive(hung), "the hung process was killed (a zombie is not alive)"
    run_until(supervisor, lambda: record.state is PartState.UP)
    assert record.restarts == 1


def test_a_part_that_crashes_on_every_start_is_given_up_after_the_bound(
        tmp_path: Path, supervisor: Supervisor, lines: list[str]) -> None:
    web, broken = http_part(tmp_path), crashing_part(tmp_path)
    ok, bad = supervisor.add(web), supervisor.add(broken)
    run_until(supervisor, lambda: bad.state is PartState.GIVEN_UP)
    assert bad.restarts == FAST.limit
    assert bad.reason == "exited (status 3) while starting"
    said = [line for line in lines if "broken" in line]
    assert len([x for x in said if "restarting it in" in x]) == FAST.limit
    assert "giving up on it after 2 restart(s) within 60 s" in said[-1]
    assert "bad flag: --no-such" in said[-1], "the end of its log is shown"
    run_until(supervisor, lambda: ok.state is PartState.UP)
    for _ in range(10):
        supervisor.tick()
    assert bad.state is PartState.GIVEN_UP and not broken.running(), "no more restarts"
    assert broken.log_path.read_text().count("bad flag") == FAST.limit + 1


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1, backoff_max_s=30)
    assert [policy.backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_restart_never_gives_up_at_the_first_failure(tmp_path: Path, lines: list[str]) -> None:
    sup = Supervisor(RestartPolicy(restart_on_failure=False, start_timeout_s=30), lines.append)
    try:
        record = sup.add(crashing_part(tmp_path))
        run_until(sup, lambda: record.state is PartState.GIVEN_UP)
        assert record.restarts == 0 and "--restart never" in lines[-1]
    finally:
        sup.close()


def test_killing_a_part_kills_the_sessions_its_children_started(tmp_path: Path) -> None:
    """As ``kvtier serve`` (the part) starts vLLM in a session of its own: after a SIGKILL of
    the part, the orphaned session must not keep the instance's port."""
    marker = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
              " start_new_session=True)\n"
              f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(300)\n")
    part = ProcessPart("serve", [sys.executable, "-c", script], tmp_path / "serve.log",
                       "http://127.0.0.1:9/health")
    part.launch()
    deadline = time.monotonic() + 20
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(marker.read_text())
    part.observe()  # the supervisor does this on every probe
    assert part.groups == {grandchild}
    assert part.pid is not None
    os.kill(part.pid, signal.SIGKILL)
    time.sleep(0.2)
    assert alive(grandchild), "an orphan, still running"
    part.kill()
    assert not group_members(grandchild) and not part.running()


def test_restart_options_are_parsed_and_checked() -> None:
    o = options("--restart", "never", "--restart-limit", "2", "--restart-window", "30s")
    assert o.restart == RestartPolicy(restart_on_failure=False, limit=2, window_s=30.0)
    assert options().restart == RestartPolicy()
    with pytest.raises(ConfigError, match="--restart-window"):
        options("--restart-window", "soon")
    with pytest.raises(ConfigError, match="--restart-limit"):
        options("--restart-limit", "-1")


def test_the_router_argv_reads_the_parts_file(tmp_path: Path) -> None:
    from kvtier.launch.front import router_argv

    argv = router_argv("kvtier", "cache", "127.0.0.1", 8000, ["http://a"], ["http://n"],
                       parts_file=tmp_path / "stack.json")
    assert argv is not None
    assert argv[argv.index("--parts-file") + 1] == str(tmp_path / "stack.json")
    out = subprocess.run([*argv[:3], "route", "--help"], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    assert "--parts-file" in out


_HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_router_that_never_comes_up_stops_the_stack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """Instances up, a router that exits at every start (a flag it refuses): once the stack
    gives up on it, it stops with status 1 instead of holding engines no one can reach (a
    benchmark waited 15 minutes on such a stack)."""
    from kvtier.launch.stack import Stack

    router = tmp_path / "vllm-router"
    router.write_text("#!/bin/sh\necho 'error: unknown option' >&2\nexit 1\n")
    router.chmod(0o755)
    o = options("--router", "vllm-router", "--vllm-router", str(router), "--shared", "none",
                "--restart-limit", "1", "--run-dir", str(tmp_path / "run"),
                "--port", str(free_port()))
    stack = Stack(o)

    def instance_part(i: int) -> ProcessPart:
        port = o.instance_port(i)
        return ProcessPart(f"instance {i}", [sys.executable, "-c", _HEALTHY, str(port)],
                           tmp_path / f"instance-{i}.log", f"http://127.0.0.1:{port}/health")

    monkeypatch.setattr(stack, "instance_part", instance_part)
    started = time.monotonic()
    rc = stack.run()
    out = capsys.readouterr()
    assert rc == 1
    assert "the vllm-router router never came up; stopping" in out.out + out.err
    assert time.monotonic() - started < 60
    assert not any(p.running() for p in stack.instances), "the instances were stopped"
