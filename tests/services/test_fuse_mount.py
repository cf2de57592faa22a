"""A SeaweedFS FUSE mount as the shared volume: several processes and mounts, and what a hung or
dead mount does to the processes using it (tests/services/hangprobe.py runs the calls in child
processes, so a stuck call never stalls the test itself)."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.errors import ServiceMissing
from kvtier.services import SeaweedFS, SeaweedMount
from kvtier.services.mounts import check_fuse

from . import fs_worker
from .hangprobe import collect, start_ops

pytestmark = pytest.mark.services
WORKER = Path(fs_worker.__file__)
MakeMount = Callable[..., SeaweedMount]


def worker(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], timeout_s: float = 60) -> str:
    out, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, out
    return out.strip()


def test_two_writers_and_a_reader_never_see_a_partial_file(seaweed_mount: SeaweedMount) -> None:
    root = seaweed_mount.path
    writers = [worker("write", root, w, 40, 64 * 1024) for w in (1, 2)]
    reader = worker("read", root, 40, 4)
    for w in writers:
        finish(w)
    assert int(finish(reader)) > 0
    files = sorted(p.name for p in root.iterdir())
    assert files == sorted(f"key-{i}" for i in range(40)), "no temp file left, none missing"
    assert all(fs_worker.complete((root / f).read_bytes()) for f in files)


def test_o_excl_admits_exactly_one_creator_per_name(seaweed_mount: SeaweedMount) -> None:
    racers = [worker("excl", seaweed_mount.path, 50) for _ in range(2)]
    wins = [set(map(int, finish(r).split())) for r in racers]
    assert not wins[0] & wins[1]
    assert wins[0] | wins[1] == set(range(50))


def test_flock_excludes_another_process(seaweed_mount: SeaweedMount) -> None:
    path = seaweed_mount.path / "lockfile"
    path.touch()
    with open(path) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        probe = subprocess.run(
            [sys.executable, "-c", "import fcntl, sys\nf = open(sys.argv[1])\n"
             "try:\n    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
             "except BlockingIOError:\n    print('busy')\n", str(path)],
            capture_output=True, text=True, timeout=30)
    assert probe.stdout.strip() == "busy"


def test_a_second_mount_sees_writes_and_renames_within_a_second(
        make_seaweed_mount: MakeMount) -> None:
    a, b = make_seaweed_mount(), make_seaweed_mount()
    for version in range(3):
        tmp = a.path / f"chunk.{version}.tmp"
        tmp.write_bytes(bytes([version]) * 4096)
        tmp.rename(a.path / "chunk")
        renamed = time.monotonic()
        while not _reads(b.path / "chunk", bytes([version]) * 4096):
            assert time.monotonic() - renamed < 1.0, "mount B never saw mount A's rename"
            time.sleep(0.005)


def _reads(path: Path, expected: bytes) -> bool:
    try:
        return path.read_bytes() == expected
    except FileNotFoundError:
        return False


def test_a_paused_mount_blocks_every_call_until_its_weed_is_stopped(
        seaweed_mount: SeaweedMount) -> None:
    (seaweed_mount.path / "x").write_bytes(b"x" * 4096)
    seaweed_mount.pause()
    pending = start_ops(seaweed_mount.path, ["stat", "read", "write_fsync"])
    done, blocked = collect(pending, 1.5)
    assert not done, f"calls on a hung mount returned: {done}"
    seaweed_mount.stop()  # SIGTERM (+SIGCONT): weed answers what it can, then unmounts
    done, blocked = collect(blocked, 5.0)
    assert not blocked, "stopping the weed process releases every caller"
    assert not seaweed_mount.mounted


def test_a_caller_blocked_on_a_hung_mount_can_be_killed(seaweed_mount: SeaweedMount) -> None:
    seaweed_mount.pause()
    pending = start_ops(seaweed_mount.path, ["listdir"])
    _, blocked = collect(pending, 1.0)
    assert blocked
    assert blocked[0].kill() < 1.0
    seaweed_mount.resume()


def test_a_killed_mount_fails_fast_with_enotconn_until_unmounted(
        seaweed_mount: SeaweedMount) -> None:
    seaweed_mount.kill()
    done, blocked = collect(start_ops(seaweed_mount.path, ["stat", "listdir"]), 5.0)
    assert not blocked
    assert {o.error for o in done} == {"ENOTCONN"}
    assert seaweed_mount.mounted, "the mount outlives its process"
    seaweed_mount.stop()
    assert not seaweed_mount.mounted


def test_calls_wait_out_a_filer_outage_and_complete_after_it(
        make_seaweedfs: Callable[..., SeaweedFS], make_seaweed_mount: MakeMount) -> None:
    weed = make_seaweedfs()
    mount = make_seaweed_mount(weed, "/")
    (mount.path / "x").write_bytes(b"x")
    weed.stop()
    pending = start_ops(mount.path, ["write_fsync"])
    _, blocked = collect(pending, 2.0)
    assert blocked, "a write on a mount whose filer is down waits; it does not fail"
    weed.start()
    done, blocked = collect(blocked, 20.0)
    assert not blocked and [o.state for o in done] == ["ok"]


def test_close_unmounts_and_removes_the_folder(make_seaweed_mount: MakeMount) -> None:
    mount = make_seaweed_mount()
    (mount.path / "f").write_bytes(b"kept on the filer")
    workdir = mount.workdir
    mount.close()
    assert not mount.mounted and not workdir.exists()
    again = make_seaweed_mount()
    assert (again.path / "f").read_bytes() == b"kept on the filer"


def test_missing_fuse_is_reported_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ServiceMissing, match=r"FUSE is unavailable.*apt-get install -y fuse3"):
        check_fuse(device=str(tmp_path / "no-fuse"))
