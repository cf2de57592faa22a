"""Working folders of services, and closing every live service when Python exits.

Each service that is not given a folder makes one under the temp dir named
``kvtier-svc-<kind>-<pid>-<random>`` and removes it when closed. What a killed test run left
(its pid is gone) is swept the next time a service makes a folder: mounts under it are
unmounted lazily, SeaweedFS sockets named in its ``ports`` file are removed, then the folder.
A folder that still has something mounted under it is never removed (that would delete files
through the mount).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Protocol

from kvtier.processes import alive
from kvtier.services.mounts import mounts_under, unmount

PREFIX = "kvtier-svc-"
_NAME = re.compile(rf"{PREFIX}[a-z]+-(\d+)-\w+")
SOCKET_DIR = Path("/tmp")  # weed puts its unix sockets here whatever TMPDIR says
PORTS_FILE = "ports"


class Closable(Protocol):
    def close(self) -> None: ...


_lock = threading.Lock()
_live: dict[int, Closable] = {}


def track(service: Closable) -> None:
    with _lock:
        _live[id(service)] = service


def untrack(service: Closable) -> None:
    with _lock:
        _live.pop(id(service), None)


@atexit.register
def close_all() -> None:
    """Close live services, newest first (a mount before the SeaweedFS it mounts)."""
    with _lock:
        services = list(_live.values())[::-1]
    for service in services:
        with contextlib.suppress(Exception):
            service.close()


def make_workdir(kind: str) -> Path:
    sweep_stale()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{os.getpid()}-"))


def remove_workdir(path: Path) -> bool:
    """Remove ``path`` unless something is still mounted under it; True when removed."""
    for mount_point in mounts_under(path):
        if not unmount(Path(mount_point), lazy=True):
            return False
    remove_weed_sockets(path)
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


def sweep_stale() -> list[Path]:
    """Remove the folders of services whose owning process is gone; the ones removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        match = _NAME.fullmatch(path.name)
        if match and not alive(int(match.group(1))) and remove_workdir(path):
            removed.append(path)
    return removed


def write_ports(workdir: Path, ports: list[int]) -> None:
    (workdir / PORTS_FILE).write_text(" ".join(str(p) for p in ports))


def remove_weed_sockets(workdir: Path) -> None:
    """Remove ``/tmp/seaweedfs-*-PORT.sock`` for the ports recorded in ``workdir``."""
    try:
        ports = (workdir / PORTS_FILE).read_text().split()
    except OSError:
        return
    for port in ports:
        for sock in SOCKET_DIR.glob(f"seaweedfs-*-{port}.sock"):
            with contextlib.suppress(OSError):
                sock.unlink()
