"""FUSE mounts: whether FUSE works here, what is mounted where, and unmounting.

A FUSE mount outlives the process that serves it: when ``weed mount`` dies, the mount point
stays and every call on it fails with ENOTCONN until someone unmounts it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from kvtier.errors import ServiceMissing

_MOUNTINFO = Path("/proc/self/mountinfo")
FUSE_HINT = ("apt-get install -y fuse3; in a container also pass --device /dev/fuse "
             "--cap-add SYS_ADMIN")


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return field.encode().decode("unicode_escape")


def mounts() -> dict[str, str]:
    """Mount point -> filesystem type, for this process's mount namespace."""
    table: dict[str, str] = {}
    for line in _MOUNTINFO.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) >= 5 and right:
            table[_unescape(fields[4])] = right.split()[0]
    return table


def is_mounted(path: Path) -> bool:
    return str(path) in mounts()


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (the order to unmount them)."""
    prefix = str(root).rstrip("/") + "/"
    found = [m for m in mounts() if m == str(root) or m.startswith(prefix)]
    return sorted(found, key=len, reverse=True)


def check_fuse(device: str = "/dev/fuse") -> None:
    """Raise ServiceMissing, saying what is missing, unless a FUSE mount can be made here."""
    if not os.path.exists(device):
        raise ServiceMissing(f"FUSE is unavailable: {device} does not exist ({FUSE_HINT})")
    try:
        os.close(os.open(device, os.O_RDWR))
    except OSError as exc:
        raise ServiceMissing(f"FUSE is unavailable: cannot open {device}: {exc} "
                             f"({FUSE_HINT})") from exc
    if "fuse" not in Path("/proc/filesystems").read_text().split():
        raise ServiceMissing(f"FUSE is unavailable: the kernel lists no fuse filesystem "
                             f"(modprobe fuse; {FUSE_HINT})")
    if os.geteuid() != 0 and fusermount() is None:
        raise ServiceMissing(f"FUSE is unavailable: not root and no fusermount3 or "
                             f"fusermount ({FUSE_HINT})")


def fusermount() -> str | None:
    return shutil.which("fusermount3") or shutil.which("fusermount")


def unmount(path: Path, *, timeout_s: float = 10.0, lazy: bool = False) -> bool:
    """Unmount ``path``; True when it is no longer mounted. Never raises for a busy mount."""
    if not is_mounted(path):
        return True
    for argv in _unmount_commands(path, lazy):
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if not is_mounted(path):
            return True
    return not is_mounted(path)


def _unmount_commands(path: Path, lazy: bool) -> list[list[str]]:
    commands: list[list[str]] = []
    helper = fusermount()
    lazy_flag = ["-z"] if lazy else []
    if os.geteuid() == 0:
        commands.append(["umount", *(["-l"] if lazy else []), str(path)])
    if helper:
        commands.append([helper, "-u", *lazy_flag, str(path)])
    return commands
