"""Arena liveness: a server removes an arena at start only if its owner's lock is free.

Real processes throughout: owners run in another PID namespace (``unshare --pid --fork``, as
containers sharing /dev/shm with ``--ipc=host`` do), are killed with SIGKILL, and real servers
start beside them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from store_helpers import server_config

from kvtier.client import KvtierClient
from kvtier.errors import ConfigError
from kvtier.server import EmbeddedServer
from kvtier.tiers.arena import Arena, ArenaMapping, default_name, shm_path, sweep_stale

UID = os.getuid()
OWNER = (
    "import sys, time\n"
    "from kvtier.tiers.arena import Arena\n"
    "arena = Arena(sys.argv[1], 2, 4096, prefault=False)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
SERVER = (
    "import json, sys, time\n"
    "from kvtier.config import ServerConfig\n"
    "from kvtier.server import NodeServer\n"
    "server = NodeServer(ServerConfig.from_dict(json.loads(sys.argv[1]))).start()\n"
    "print(server.arena_name, flush=True)\n"
    "time.sleep(120)\n"
)


def dead_pid() -> int:
    """A pid that named a process here a moment ago and names none now."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True, timeout=30)
    return int(done.stdout)


def unused_name(pid: int) -> str:
    return f"kvtier-arena-{UID}-{pid}-{secrets.token_hex(8)}"


def in_other_pid_namespace(script: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Run ``script`` as pid 1 of a new PID namespace; returns it and its first line."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to make a PID namespace")
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().strip() if ready else ""
    if not line:
        kill(proc)
        pytest.fail("the process in the other PID namespace did not start in 60 s")
    return proc, line


def kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL unshare and the process it forked (same process group), and reap unshare."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.stdout:
        proc.stdout.close()


def swept_within(name: str, seconds: float = 10.0) -> bool:
    """Whether a sweep removes ``name`` within ``seconds`` (the killed owner's fds close
    a moment after SIGKILL)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if name in sweep_stale():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Names in /dev/shm to remove after the test, whatever happened."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(name))


def test_a_live_arena_in_another_pid_namespace_survives_until_its_owner_is_killed(
        tmp_path: Path, cleanup: list[str]) -> None:
    name = unused_name(dead_pid())  # the old rule, kill(pid, 0), called this owner dead
    cleanup.append(name)
    owner, _ = in_other_pid_namespace(OWNER, name)
    try:
        assert name not in sweep_stale()
        with EmbeddedServer(server_config(tmp_path)):  # a server's start sweeps
            assert os.path.exists(shm_path(name))
    finally:
        kill(owner)
    assert swept_within(name)
    assert not os.path.exists(shm_path(name))


def test_a_server_killed_in_another_namespace_is_cleaned_by_the_next_start(
        tmp_path: Path) -> None:
    crashed_config = {"socket_path": str(tmp_path / "crashed.sock"),
                      "arena": {"size_bytes": 4 * 8192, "slot_bytes": 8192}}
    crashed, arena_name = in_other_pid_namespace(SERVER, json.dumps(crashed_config))
    try:
        with EmbeddedServer(server_config(tmp_path)) as beside:
            assert os.path.exists(shm_path(arena_name)), "a live server's arena was removed"
            with KvtierClient(str(tmp_path / "crashed.sock")) as client:
                assert client.connect().arena_name == arena_name  # and it still serves
            assert beside.arena_name != arena_name
    finally:
        kill(crashed)
    deadline = time.monotonic() + 10
    while os.path.exists(shm_path(arena_name)) and time.monotonic() < deadline:
        with EmbeddedServer(server_config(tmp_path)):
            pass
    assert not os.path.exists(shm_path(arena_name)), "the crashed server's arena was kept"


def test_engine_mappings_neither_take_nor_drop_the_lock(cleanup: list[str]) -> None:
    owner = Arena(default_name(), 2, 4096, prefault=False)
    cleanup.append(owner.name)
    try:
        for _ in range(3):  # each mapping opens and closes its own descriptor
            ArenaMapping(owner.name, 2, 4096, create=False).close()
        child = ("import sys\nfrom kvtier.tiers.arena import ArenaMapping, sweep_stale\n"
                 "m = ArenaMapping(sys.argv[1], 2, 4096, create=False)\n"
                 "print(sys.argv[1] in sweep_stale())\nm.close()\n")
        out = subprocess.run([sys.executable, "-c", child, owner.name], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        assert out.strip() == "False"
        assert owner.name not in sweep_stale()
        owner.close()  # unmapped, still owned: the owner may yet unlink it
        assert owner.name not in sweep_stale()
    finally:
        owner.close()
        owner.unlink()
    assert not os.path.exists(shm_path(owner.name))


def test_an_arena_dropped_without_unlink_is_swept(cleanup: list[str]) -> None:
    name = default_name()
    cleanup.append(name)
    Arena(name, 2, 4096, prefault=False).close()  # collected at once: its lock goes with it
    assert name in sweep_stale()
    assert not os.path.exists(shm_path(name))


def test_arenas_of_older_versions_are_kept_and_logged(
        cleanup: list[str], caplog: pytest.LogCaptureFixture) -> None:
    legacy = f"kvtier-{UID}-{dead_pid()}-{secrets.token_hex(4)}"  # no lock, pid dead here
    cleanup.append(legacy)
    Path(shm_path(legacy)).write_bytes(b"old")
    with caplog.at_level(logging.WARNING, logger="kvtier.server"):
        assert legacy not in sweep_stale()
    assert Path(shm_path(legacy)).read_bytes() == b"old"
    assert any(legacy in record.getMessage() for record in caplog.records)


def test_the_sweep_never_follows_links_nor_touches_others_files(
        tmp_path: Path, cleanup: list[str]) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link, fifo, foreign = unused_name(1), unused_name(1), unused_name(1)
    other_users = f"kvtier-arena-{UID + 4321}-1-{secrets.token_hex(8)}"
    cleanup += [link, fifo, foreign, other_users]
    os.symlink(target, shm_path(link))
    os.mkfifo(shm_path(fifo), 0o600)  # opening it to read would block a careless sweep
    Path(shm_path(other_users)).write_bytes(b"theirs")
    Path(shm_path(foreign)).write_bytes(b"theirs")
    if UID == 0:
        os.chown(shm_path(foreign), 4321, 4321)  # our name pattern, another user's file
    removed = sweep_stale()
    assert link not in removed and os.path.islink(shm_path(link))
    assert target.read_bytes() == b"keep me"
    assert fifo not in removed and os.path.exists(shm_path(fifo))
    assert other_users not in removed and os.path.exists(shm_path(other_users))
    if UID == 0:
        assert foreign not in removed and os.path.exists(shm_path(foreign))


def test_a_sweep_racing_creations_never_takes_a_fresh_arena(cleanup: list[str]) -> None:
    sweeper = subprocess.Popen(
        [sys.executable, "-c",
         "import time\nfrom kvtier.tiers.arena import sweep_stale\n"
         "end = time.monotonic() + 3\nn = 0\n"
         "while time.monotonic() < end:\n    n += len(sweep_stale())\nprint(n)\n"],
        stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)  # let it import and start sweeping
        made = 0
        while sweeper.poll() is None and made < 2000:
            arena = Arena(default_name(), 1, 4096, prefault=False)
            cleanup.append(arena.name)
            token = secrets.token_bytes(16)
            arena.slot(0)[:16] = token
            time.sleep(0.0005)
            with open(shm_path(arena.name), "rb") as f:  # the name still names our memory
                assert f.read(16) == token
            arena.close()
            arena.unlink()
            made += 1
    finally:
        out, _ = sweeper.communicate(timeout=60)
    assert sweeper.returncode == 0 and int(out) >= 0
    assert made > 50, "too few creations raced the sweeper to mean anything"


def test_a_name_held_by_a_live_owner_cannot_be_created_again(cleanup: list[str]) -> None:
    owner = Arena(default_name(), 1, 4096, prefault=False)
    cleanup.append(owner.name)
    try:
        with pytest.raises(ConfigError, match="already exists"):
            Arena(owner.name, 1, 4096, prefault=False)
        assert os.path.exists(shm_path(owner.name))
        assert owner.name not in sweep_stale()
    finally:
        owner.close()
        owner.unlink()



def test_a_creating_name_left_by_a_killed_creator_is_swept_once_old(cleanup: list[str]) -> None:
    name = default_name() + ".creating"
    cleanup.append(name)
    Path(shm_path(name)).write_bytes(b"")
    assert name not in sweep_stale(), "a young creating name may belong to a live creator"
    old = time.time() - 3600
    os.utime(shm_path(name), (old, old))
    assert name in sweep_stale()
    assert not os.path.exists(shm_path(name))


def test_creation_leaves_no_creating_name_and_refuses_a_taken_one(cleanup: list[str]) -> None:
    name = default_name()
    cleanup += [name, name + ".creating"]
    Path(shm_path(name + ".creating")).write_bytes(b"")
    with pytest.raises(ConfigError, match="being created"):
        Arena(name, 1, 4096, prefault=False)
    assert not os.path.exists(shm_path(name))
    os.unlink(shm_path(name + ".creating"))
    arena = Arena(name, 1, 4096, prefault=False)
    try:
        assert not os.path.exists(shm_path(name + ".creating"))
        assert name not in sweep_stale()
    finally:
        arena.close()
        arena.unlink()
