"""What a process listens on, read from /proc (no ss/netstat needed on a bare machine)."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path

_LISTEN = "0A"


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, IPv4 and IPv6."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                found.add(_decode(local, family))
    return found


def _decode(local: str, family: int) -> tuple[str, int]:
    addr_hex, port_hex = local.split(":")
    raw = bytes.fromhex(addr_hex)
    # /proc/net/tcp prints each 32-bit word in host (little-endian) order
    words = struct.unpack("<" + "I" * (len(raw) // 4), raw)
    packed = struct.pack(">" + "I" * len(words), *words)
    return socket.inet_ntop(family, packed), int(port_hex, 16)
