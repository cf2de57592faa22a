"""What a stuck or dead FUSE mount does to the processes using it, measured.

Each file operation runs in a child process, so a call that blocks in the kernel blocks only
the child: the parent watches the clock, reports ``blocked`` past a deadline, and later sees
whether (and how) the call returns once the mount is resumed, stopped or unmounted.

    python tests/services/hangprobe.py [--block-s 5] [--wait-s 30] [--json FILE]

runs every scenario against a fresh SeaweedFS and mount and prints one line per operation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from kvtier.services.mount import SeaweedMount
from kvtier.services.seaweedfs import SeaweedFS

# Each snippet gets the mount's folder as {root}; "x" is a file written before the fault.
OPS: dict[str, str] = {
    "stat": "os.stat(root + '/x')",
    "stat_missing": ("try: os.stat(root + '/missing-' + str(os.getpid()))\n"
                     "    except FileNotFoundError: pass"),
    "read": "open(root + '/x', 'rb').read()",
    "listdir": "os.listdir(root)",
    "write_fsync": ("f = open(root + '/w-' + str(os.getpid()), 'wb'); f.write(b'y' * 1048576); "
                    "f.flush(); os.fsync(f.fileno()); f.close()"),
    "rename": ("n = root + '/r-' + str(os.getpid()); open(n, 'wb').close(); "
               "os.rename(n, n + '.renamed')"),
    "open_excl": "os.close(os.open(root + '/e-' + str(os.getpid()), os.O_CREAT | os.O_EXCL))",
}
READS = ["stat", "stat_missing", "read", "listdir"]
WRITES = ["write_fsync", "rename", "open_excl"]
_CHILD = ("import os, sys\nroot = sys.argv[1]\ntry:\n    {op}\n"
          "except OSError as e:\n    import errno\n"
          "    print(errno.errorcode.get(e.errno, e.errno)); sys.exit(3)\n")


State = Literal["ok", "error", "blocked"]


@dataclass(frozen=True)
class Outcome:
    op: str
    state: State        # on "error", ``error`` is the errno name (ENOTCONN, EIO, ...)
    seconds: float      # until it returned, or until we stopped waiting
    error: str = ""


@dataclass
class Pending:
    op: str
    child: subprocess.Popen[str]
    started: float

    def poll(self, since: float) -> Outcome | None:
        """The outcome once the child has exited, timed from ``since``."""
        if self.child.poll() is None:
            return None
        out = ""
        if self.child.stdout:
            out = self.child.stdout.read().strip()
            self.child.stdout.close()
        ok = self.child.returncode == 0
        error = "" if ok else out or f"exit {self.child.returncode}"
        return Outcome(self.op, "ok" if ok else "error", round(time.monotonic() - since, 2),
                       error)

    def kill(self) -> float:
        """SIGKILL the child; seconds until it was gone (a blocked FUSE call is killable)."""
        start = time.monotonic()
        self.child.kill()
        self.child.wait()
        if self.child.stdout:
            self.child.stdout.close()
        return round(time.monotonic() - start, 3)


def start_ops(root: Path, ops: list[str] | None = None) -> list[Pending]:
    """Start each operation in its own child process; they run concurrently."""
    pending = []
    for op in ops or list(OPS):
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(op=OPS[op]), str(root)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        pending.append(Pending(op, child, time.monotonic()))
    return pending


def collect(pending: list[Pending], wait_s: float, *,
            since: float | None = None) -> tuple[list[Outcome], list[Pending]]:
    """Outcomes of the operations that returned within ``wait_s`` (timed from ``since``, by
    default each one's start), and the operations still blocked."""
    deadline = time.monotonic() + wait_s
    done: list[Outcome] = []
    left = list(pending)
    while left:
        for p in list(left):
            outcome = p.poll(p.started if since is None else since)
            if outcome is not None:
                done.append(outcome)
                left.remove(p)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return done, left


def still_blocked(left: list[Pending], since: float) -> list[Outcome]:
    return [Outcome(p.op, "blocked", round(time.monotonic() - since, 2)) for p in left]


Report = dict[str, list[dict[str, object]]]


@dataclass(frozen=True)
class Scenario:
    """``fault`` breaks the mount, ``release`` ends the fault; with ``kill_blocked`` the blocked
    callers are SIGKILLed first (does a kill get a process out of a stuck call?)."""

    fault: Callable[[SeaweedFS, SeaweedMount], None]
    release: Callable[[SeaweedFS, SeaweedMount], None]
    kill_blocked: bool = False


SCENARIOS: dict[str, Scenario] = {
    "mount_paused_then_resumed": Scenario(lambda w, m: m.pause(), lambda w, m: m.resume()),
    "mount_paused_then_stopped": Scenario(lambda w, m: m.pause(), lambda w, m: m.stop()),
    "mount_paused_then_killed": Scenario(lambda w, m: m.pause(), lambda w, m: m.kill()),
    "mount_paused_callers_killed": Scenario(lambda w, m: m.pause(), lambda w, m: m.resume(),
                                            kill_blocked=True),
    "mount_killed_then_unmounted": Scenario(lambda w, m: m.kill(), lambda w, m: m.stop()),
    "filer_paused_then_resumed": Scenario(lambda w, m: w.pause(), lambda w, m: w.resume()),
    "filer_stopped_then_started": Scenario(lambda w, m: w.stop(), lambda w, m: _start(w)),
    "filer_paused_then_mount_stopped": Scenario(lambda w, m: w.pause(), lambda w, m: m.stop()),
}


def _start(weed: SeaweedFS) -> None:
    weed.start()


def _phase(root: Path, ops: list[str], block_s: float,
           left: list[Pending]) -> list[dict[str, object]]:
    pending = start_ops(root, ops)
    done, still = collect(pending, block_s)
    left += still
    return [asdict(o) for o in done + still_blocked(still, pending[0].started)]


def measure(weed: SeaweedFS, mount: SeaweedMount, scenario: Scenario, *, block_s: float,
            wait_s: float) -> Report:
    """Break the mount; run the reads, then the writes, then the reads again behind any
    blocked writes, each phase reported after ``block_s``; then release the fault and report
    how the blocked calls end within ``wait_s`` (timed from the release)."""
    root = mount.path
    scenario.fault(weed, mount)
    left: list[Pending] = []
    report: Report = {"reads": _phase(root, READS, block_s, left),
                      "writes": _phase(root, WRITES, block_s, left),
                      "reads_behind_writes": _phase(root, READS, block_s, left)}
    if scenario.kill_blocked:
        report["kill_s"] = [{"op": p.op, "seconds": p.kill()} for p in left]
        left = []
    released_at = time.monotonic()
    scenario.release(weed, mount)
    after, left = collect(left, wait_s, since=released_at)
    report["after_release"] = [asdict(o) for o in after + still_blocked(left, released_at)]
    for p in left:
        p.kill()
    return report


def run_scenario(name: str, *, block_s: float, wait_s: float, settle_s: float) -> Report:
    """One scenario on a fresh SeaweedFS and mount, with a 4 KiB file ``x`` written (fsync)
    and read back ``settle_s`` before the fault."""
    with SeaweedFS() as weed, SeaweedMount(weed.filer_address) as mount:
        with open(mount.path / "x", "wb") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
        time.sleep(settle_s)
        (mount.path / "x").read_bytes()
        return measure(weed, mount, SCENARIOS[name], block_s=block_s, wait_s=wait_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure what a stuck FUSE mount does.")
    parser.add_argument("--block-s", type=float, default=5.0,
                        help="how long to wait before calling an operation blocked")
    parser.add_argument("--wait-s", type=float, default=30.0,
                        help="how long to wait for blocked operations after the release")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="how long the file x exists before the fault")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only these (default: all)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = {name: run_scenario(name, block_s=args.block_s, wait_s=args.wait_s,
                                 settle_s=args.settle_s)
               for name in args.scenario or list(SCENARIOS)}
    for scenario, phases in results.items():
        print(scenario)
        for phase, outcomes in phases.items():
            for o in outcomes:
                print(f"  {phase:20} {o['op']:13} {o.get('state', 'killed'):8} "
                      f"{o['seconds']:>6}s {o.get('error', '')}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
