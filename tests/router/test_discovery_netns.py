"""``--backends-dns`` through the real system resolver, for a name with several addresses:
a network namespace of the test's own (``kvd-PID-N``, loopback only, torn down in any
case) whose hosts file ``ip netns exec`` bind-mounts over /etc/hosts; stub backends on
127.0.0.2-4 in it (tests/router/dns_fleet.py). Needs root and iproute2; skipped otherwise."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_names = itertools.count()


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def namespace() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    name = f"kvd-{os.getpid()}-{next(_names)}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    folder = Path("/etc/netns") / name
    try:
        assert _ip("-n", name, "link", "set", "lo", "up").returncode == 0
        folder.mkdir(parents=True)
        (folder / "hosts").write_text("127.0.0.1 localhost\n127.0.0.2 fleet.kvd.test\n"
                                      "127.0.0.3 fleet.kvd.test\n")
        yield name
    finally:
        _ip("netns", "del", name)  # kills nothing: the script has exited or timed out
        shutil.rmtree(folder, ignore_errors=True)
        assert name not in _ip("netns", "list").stdout


def test_a_name_with_several_addresses_is_followed_through_the_system_resolver(
        namespace: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(["ip", "netns", "exec", namespace, sys.executable,
                          str(HERE / "dns_fleet.py")], capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"\n{seen}")
    assert seen["first"] == ["http://127.0.0.2:8000", "http://127.0.0.3:8000"]
    assert seen["nodes"] == ["http://127.0.0.2:8100", "http://127.0.0.3:8100"]
    assert seen["joined_after_s"] is not None, "the newcomer never got a request"
    assert seen["joined_after_s"] < seen["interval_s"] + 0.3
    assert seen["after"] == ["http://127.0.0.3:8000", "http://127.0.0.4:8000"]
    assert seen["late_at_gone"] == 0
