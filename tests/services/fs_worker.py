"""A separate process working on a shared folder, for tests of two writers on one mount.

    python fs_worker.py write ROOT WRITER COUNT SIZE   publish COUNT files as tmp+fsync+rename
    python fs_worker.py read ROOT COUNT SECONDS        read them in a loop; exit 1 on a torn file
    python fs_worker.py excl ROOT COUNT                try O_EXCL on each name; print the wins

A file is ``WRITER`` (1 byte) + payload + sha256(payload) (32 bytes): a reader can tell a
complete file from a partial one without knowing who wrote it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path


def body(writer: int, size: int, i: int) -> bytes:
    payload = bytes([writer]) * 16 + os.urandom(size) + i.to_bytes(4, "little")
    return bytes([writer]) + payload + hashlib.sha256(payload).digest()


def complete(data: bytes) -> bool:
    return len(data) > 33 and hashlib.sha256(data[1:-32]).digest() == data[-32:]


def write(root: Path, writer: int, count: int, size: int) -> int:
    for i in range(count):
        tmp = root / f"key-{i}.{os.getpid()}.{writer}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, body(writer, size, i))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, root / f"key-{i}")
    return 0


def read(root: Path, count: int, seconds: float) -> int:
    deadline, reads = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        for i in range(count):
            try:
                data = (root / f"key-{i}").read_bytes()
            except FileNotFoundError:
                continue
            reads += 1
            if not complete(data):
                print(f"torn key-{i}: {len(data)} bytes", flush=True)
                return 1
    print(reads, flush=True)
    return 0


def excl(root: Path, count: int) -> int:
    wins = []
    for i in range(count):
        try:
            os.close(os.open(root / f"lock-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        wins.append(i)
    print(" ".join(map(str, wins)), flush=True)
    return 0


if __name__ == "__main__":
    mode, root, *rest = sys.argv[1:]
    if mode == "write":
        sys.exit(write(Path(root), int(rest[0]), int(rest[1]), int(rest[2])))
    if mode == "read":
        sys.exit(read(Path(root), int(rest[0]), float(rest[1])))
    sys.exit(excl(Path(root), int(rest[0])))
