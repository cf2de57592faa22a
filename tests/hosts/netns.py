"""Hosts of their own on one machine: network namespaces on a private switch (tests only).

::

    root namespace: no address, no route, no link of the test's
    ┌───────────── kvh-PID-N-sw ─────────────┐
    │  bridge br0 (no address)               │
    │   ├─ veth p1 ─────┐   ├─ veth p2 ──┐   │
    └───────────────────┼────────────────┼───┘
      kvh-PID-N-h1: eth0 10.213.X.1/24   kvh-PID-N-h2: eth0 10.213.X.2/24   ...

Every veth is made inside a namespace of the test (``ip -n``), so no link and no address ever
appears in the root namespace; the subnet has no route out. Processes run in a host with
``ip netns exec`` (``Host.spawn``), each in a session of its own and killed when the test
process dies; the test's own code talks from a host with ``Host.call``, which runs a function
in a thread that joined the host's namespace (``setns`` moves only that thread).

``Network.close`` kills every process it started by its PID, then what else runs in its
namespaces (``ip netns pids``), then deletes the namespaces (a host's veth goes with it).
``sweep_stale`` does the same for the namespaces of test processes that are gone (N counts the
networks of one test process).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from kvtier.processes import alive, spawn

PREFIX = "kvh-"
ETC_NETNS = Path("/etc/netns")
"""``ip netns exec NAME`` puts the files of ETC_NETNS/NAME over /etc's (a host's resolver)."""
_STALE = re.compile(rf"{PREFIX}(\d+)-")
_CLONE_NEWNET = 0x40000000
_STOP_S = 10.0
_networks = itertools.count()
_open: set[Network] = set()
T = TypeVar("T")


class NetnsError(RuntimeError):
    """An ``ip`` command of the harness failed."""


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot make hosts (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def ns_pids(name: str) -> list[int]:
    return [int(p) for p in ip("netns", "pids", name, check=False).split()]


def sweep_stale() -> list[str]:
    """Remove the ``kvh-PID-*`` namespaces whose test process ``PID`` is gone (and the
    hosts files they had in /etc/netns)."""
    gone = [n for n in namespaces()
            if (m := _STALE.match(n)) and not alive(int(m.group(1)))]
    for name in gone:
        _empty(name)
        ip("netns", "del", name, check=False)
    if ETC_NETNS.is_dir():
        for folder in ETC_NETNS.iterdir():
            if (m := _STALE.match(folder.name)) and not alive(int(m.group(1))):
                shutil.rmtree(folder, ignore_errors=True)
    return gone


def _empty(name: str) -> None:
    """Kill whatever still runs in namespace ``name`` (processes this harness started)."""
    for pid in ns_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + _STOP_S
    while ns_pids(name) and time.monotonic() < deadline:
        time.sleep(0.05)


class Host:
    """One namespace with one address on the switch."""

    def __init__(self, network: Network, name: str, address: str) -> None:
        self.network = network
        self.name = name
        self.address = address
        self._pool: ThreadPoolExecutor | None = None

    def url(self, port: int, path: str = "") -> str:
        return f"http://{self.address}:{port}{path}"

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def spawn(self, argv: Sequence[str], *, log: Path, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, cpus: Sequence[int] | None = None
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this host, output to ``log``; the network kills it on close."""
        with open(log, "ab") as out:
            popen = spawn(self.argv(argv), out=out, env=env, cwd=cwd,
                          death_signal=signal.SIGKILL, cpus=cpus)
        self.network.adopt(popen)
        return popen

    def run(self, argv: Sequence[str], *, timeout_s: float = 30.0,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(argv), capture_output=True, text=True,
                              timeout=timeout_s, env=env)

    def call(self, fn: Callable[..., T], *args: Any, timeout_s: float = 60.0, **kw: Any) -> T:
        """``fn(*args, **kw)`` in a thread inside this host's namespace (up to 4 at once)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix=self.name,
                                            initializer=_enter, initargs=(self.name,))
        return self._pool.submit(fn, *args, **kw).result(timeout=timeout_s)

    def hosts_file(self, names: Mapping[str, Sequence[str]]) -> None:
        """What this host's resolver answers: each name's addresses (its own /etc/hosts, seen
        by the processes :meth:`spawn` starts from now on); removed with the network."""
        folder = ETC_NETNS / self.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, addresses in names.items()
            for address in addresses))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address}>"


def _enter(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


class Network:
    """A switch namespace with a bridge, and hosts attached to it; ``with`` closes it."""

    def __init__(self, *, subnet: int | None = None) -> None:
        pid = os.getpid()
        n = next(_networks)
        self.prefix = f"{PREFIX}{pid}-{n}-"
        self.subnet = f"10.213.{subnet if subnet is not None else (pid + n) % 250}"
        self.switch = f"{self.prefix}sw"
        self.hosts: list[Host] = []
        self.isolated: list[str] = []
        self._children: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        _open.add(self)
        ip("netns", "add", self.switch)
        try:
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def add_host(self, label: str | None = None) -> Host:
        n = len(self.hosts) + 1
        name = f"{self.prefix}{label or f'h{n}'}"
        ip("netns", "add", name)
        host = Host(self, name, f"{self.subnet}.{n}")
        self.hosts.append(host)
        port = f"p{n}"
        ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port,
           "netns", self.switch)
        ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        ip("-n", name, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        return host

    def add_isolated(self, label: str = "outside") -> Host:
        """A namespace on no switch (loopback only): a host that must not reach the others."""
        name = f"{self.prefix}{label}"
        ip("netns", "add", name)
        self.isolated.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        return Host(self, name, "127.0.0.1")

    def adopt(self, popen: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._children.append(popen)

    def names(self) -> list[str]:
        return [self.switch, *(h.name for h in self.hosts), *self.isolated]

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL), then delete every namespace."""
        _open.discard(self)
        for host in self.hosts:
            host.close()
        with self._lock:
            children, self._children = self._children, []
        for popen in children:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_S
        for popen in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=_STOP_S)
        existing = set(namespaces())
        for name in reversed(self.names()):
            if name in existing:
                _empty(name)
                ip("netns", "del", name, check=False)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@atexit.register
def close_all() -> None:
    """What an interrupted run left open (finalizers that did not run)."""
    for network in list(_open):
        network.close()


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(no log: {exc})"


def wait_for(probe: Callable[[], T], *, timeout_s: float, what: str,
             every_s: float = 0.1, popen: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; bounded in time (and so in count)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if popen is not None and popen.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({popen.returncode}); "
                                 f"{log_tail(log) if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s; "
                                 f"{log_tail(log) if log else ''}")
        time.sleep(every_s)
