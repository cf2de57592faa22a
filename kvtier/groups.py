"""Process groups this process started: who is still in one, and stopping all of it.

A server started in a session of its own (``start_new_session=True``) leads a process group
that also holds what it started (vLLM's API server and its EngineCore). When the leader exits
first — it crashed, or it was never ready — its children are still in the group, so stopping
must signal the group whether or not the leader is alive. Only groups this process started
are signalled, by their id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

_POLL_S = 0.05


def _processes() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process /proc shows now."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # the name may hold spaces and ')'
        if len(fields) > 2:
            yield int(entry), fields[0], int(fields[1]), int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Processes still in process group ``pgid``, zombies left out."""
    return [pid for pid, state, _ppid, group in _processes() if group == pgid and state != "Z"]


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(popen: subprocess.Popen[bytes], timeout_s: float,
               leader_first: bool = False) -> int:
    """Stop the group ``popen`` leads (it must have been started in a new session): SIGTERM,
    up to ``timeout_s`` for the leader and every member to go, then SIGKILL to what is left.
    Works when the leader has already exited (its orphans are still in the group).

    ``leader_first``: SIGTERM only the leader, which stops what it started (a clean vLLM
    shutdown), and the group only once the leader is gone. Returns the leader's status."""
    pgid = popen.pid
    deadline = time.monotonic() + timeout_s
    if leader_first and popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    signal_group(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=max(0.0, deadline - time.monotonic()))
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    signal_group(pgid, signal.SIGKILL)
    popen.wait(timeout=30)
    gone = time.monotonic() + 5.0  # SIGKILLed members take a moment to become zombies
    while group_members(pgid) and time.monotonic() < gone:
        time.sleep(_POLL_S)
    return popen.returncode


def child_groups(pid: int) -> set[int]:
    """Process groups led by children of ``pid`` that left its group (a child started in a
    session of its own, as ``kvtier serve`` starts vLLM): what to stop besides ``pid``'s own
    group, noted while ``pid`` lives (once it dies, its children are no longer its)."""
    return {group for _pid, _state, ppid, group in _processes() if ppid == pid and group != pid}
