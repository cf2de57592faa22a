"""The one process module with real processes: zombies are neither alive nor group members,
a paused group still stops on SIGTERM, groups a child started in sessions of their own are
found and killed, readiness polling tells ready from exited from too late, log tails, and a
supervising loop stops on a storm of signals instead of deadlocking in its handler."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.processes import (
    Child,
    StopRequest,
    alive,
    child_groups,
    group_members,
    kill_groups,
    log_tail,
    spawn,
    stop_group,
    wait_ready,
)


def _zombie_of_a_group() -> subprocess.Popen[bytes]:
    """A group leader that exited and is not reaped yet (only ``poll`` would reap it)."""
    popen = spawn([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "it never exited"
        time.sleep(0.02)
    return popen


def test_a_zombie_is_neither_alive_nor_a_member_of_its_group() -> None:
    popen = _zombie_of_a_group()
    try:
        assert os.getpgid(popen.pid) == popen.pid, "it still exists, as a zombie"
        assert not alive(popen.pid)
        assert group_members(popen.pid) == []
    finally:
        popen.wait(timeout=10)
    assert alive(os.getpid()) and not alive(0) and not alive(-1)


def test_a_paused_group_stops_on_sigterm_within_the_grace(tmp_path: Path) -> None:
    child = Child.start("paused", [sys.executable, "-c", "import time; time.sleep(300)"],
                        tmp_path / "p.log")
    child.signal_group(signal.SIGSTOP)
    started = time.monotonic()
    rc = stop_group(child.popen, 20.0)
    assert rc == -signal.SIGTERM, "SIGTERM took effect (SIGCONT let it run), no SIGKILL"
    assert time.monotonic() - started < 10
    assert group_members(child.pid) == []


def test_groups_a_child_started_are_found_and_killed(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
              f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(300)\n")
    child = Child.start("parent", [sys.executable, "-c", script], tmp_path / "c.log")
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, child.tail()
            time.sleep(0.05)
        grandchild = int(marker.read_text())
        assert child_groups(child.pid) == {grandchild}
        assert child_groups(grandchild) == set(), "a childless process started no group"
        kill_groups({grandchild})
        assert not alive(grandchild) and group_members(grandchild) == []
        assert child.running, "only the noted group was killed"
    finally:
        child.kill()
    assert group_members(child.pid) == [] and not child.running


def test_wait_ready_tells_ready_from_exited_from_too_late() -> None:
    answers = iter([None, "", "model-a"])
    assert wait_ready(lambda: next(answers), timeout_s=5, every_s=0.01) == "model-a"
    calls: list[int] = []
    assert wait_ready(lambda: calls.append(1), timeout_s=5, alive=lambda: len(calls) < 3,
                      every_s=0.01) is None
    assert len(calls) == 3, "it stops asking once the process is gone"
    started = time.monotonic()
    assert wait_ready(lambda: False, timeout_s=0.2, every_s=0.05) is None
    assert 0.2 <= time.monotonic() - started < 5


def test_log_tail_gives_the_last_lines_within_the_last_bytes(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)) + b"\xff bad utf-8\n")
    assert log_tail(log, 3).splitlines() == ["line 998", "line 999", "\ufffd bad utf-8"]
    assert len(log_tail(log, 1000, max_bytes=100)) <= 100
    assert log_tail(tmp_path / "missing.log") == "(no log)"


def test_a_childs_output_is_this_runs_only(tmp_path: Path) -> None:
    log = tmp_path / "c.log"
    log.write_text("an earlier run\n")
    child = Child.start("echo", ["echo", "this run"], log, header="--- start echo\n")
    assert child.popen.wait(timeout=30) == 0
    assert child.output() == "--- start echo\nthis run\n"
    assert child.tail(5) == "an earlier run\n--- start echo\nthis run"
    assert child.argv == ("echo", "this run")


def test_a_child_bound_to_cpus_runs_there_and_so_does_what_it_starts(tmp_path: Path) -> None:
    """``cpus`` is set before the child runs a line of its own, and its children inherit it:
    a kvtier instance imports torch, whose MKL pins it to each allowed core in turn."""
    mine = sorted(os.sched_getaffinity(0))
    one = mine[-1]
    script = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
              "print(subprocess.run([sys.executable, '-c', "
              "'import os; print(sorted(os.sched_getaffinity(0)))'], "
              "capture_output=True, text=True).stdout.strip())")
    child = Child.start("bound", [sys.executable, "-c", script], tmp_path / "log", cpus={one})
    assert child.wait_stopped(time.monotonic() + 60) == 0
    assert child.output().split() == [f"[{one}]", f"[{one}]"]
    assert sorted(os.sched_getaffinity(0)) == mine  # the parent's own is untouched


def test_no_cpus_at_all_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cpus"):
        spawn([sys.executable, "-c", "pass"], cpus=set())


_LOOP = """
import os, threading
from kvtier.processes import StopRequest
busy = threading.Event()
with StopRequest() as stop:
    print("ready", flush=True)
    while not stop.requested:
        busy.wait(0.0005)  # the main thread takes and releases a lock all the time
        stop.sleep(0.001)
    print("stopped", flush=True)
    os._exit(0)  # before the default handlers are back: signals are still arriving
"""


def test_a_storm_of_signals_stops_the_loop_and_never_deadlocks_it() -> None:
    """Three hundred SIGTERM/SIGINT while the main thread keeps waiting on an Event, eight
    times: a handler that set an Event itself hung in about one such storm in fifteen here
    (the signal landing while that Event's lock is held), for good."""
    for _ in range(8):
        child = subprocess.Popen([sys.executable, "-c", _LOOP], stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            for i in range(300):
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
            out, _ = child.communicate(timeout=20)
        finally:
            child.kill()
        assert child.returncode == 0 and out.strip() == "stopped"


def test_a_stop_request_restores_the_handlers_it_replaced() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGTERM) != before
        assert stop.sleep(0.01) is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.sleep(5) is True and stop.requested
    assert signal.getsignal(signal.SIGTERM) == before
