"""Chunk files, for the tiers that keep one file per chunk (``disk``, ``fs``).

A chunk is written under a unique temporary name, flushed and renamed into place, so a reader
sees either no file or a whole one, and two writers of one key (two servers on a shared mount)
never write into the same file. Reads and writes bypass the page cache with O_DIRECT where
the filesystem allows it and the buffer is page aligned (arena slots are).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvtier import codec
from kvtier.config import ConfigStruct
from kvtier.errors import ChunkTooLarge, ConfigError, TierFull, TierIOError
from kvtier.tiers.base import Space

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


class FileOptions(ConfigStruct, frozen=True):
    """``options`` of a tier keeping one file per chunk (``disk``; ``fs`` besides its sharing
    keys)."""

    path: str
    o_direct: Literal["auto", "on", "off"] = "auto"
    fsync: bool = True
    dir_fsync: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path: expected a directory path, got an empty string")


def choose_o_direct(options: FileOptions, tmp: str, where: str) -> bool:
    """Whether to use O_DIRECT under ``tmp``: ``auto`` probes, ``on`` insists."""
    if options.o_direct == "off":
        return False
    try:
        supported = probe_o_direct(tmp)
    except OSError as exc:
        raise ConfigError(f"{where}.path: cannot use {tmp!r}: {exc}") from exc
    if options.o_direct == "on" and not supported:
        raise ConfigError(f"{where}.o_direct: the filesystem of {tmp!r} refuses O_DIRECT; "
                          "use auto or off")
    return supported


def space(path: str) -> Space | None:
    """Room on the filesystem holding ``path`` (``None`` when it cannot be asked)."""
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    return Space(free=info.f_bavail * info.f_frsize, total=info.f_blocks * info.f_frsize)


@contextlib.contextmanager
def os_errors(tier: str, what: str) -> Iterator[None]:
    """Re-raise OSError as the kvtier error the store acts on (TierFull: make room)."""
    try:
        yield
    except TierIOError:
        raise
    except OSError as exc:
        cls = TierFull if exc.errno in (errno.ENOSPC, errno.EDQUOT) else TierIOError
        raise cls(exc.errno, f"{tier} tier: {what}: {exc.strerror}", exc.filename) from exc


def temp_name(stem: str, token: str) -> str:
    """``<stem>.<host>.<pid>.<token><random>.tmp``: unique across processes and nodes."""
    host = socket.gethostname().replace(".", "-")[:32] or "host"
    return f"{stem}.{host}.{os.getpid()}.{token}{secrets.token_hex(4)}.tmp"


@dataclass(frozen=True)
class FileIO:
    o_direct: bool
    fsync: bool
    dir_fsync: bool = False

    def write_atomic(self, final: str, tmp: str, view: memoryview) -> int:
        """Write ``view`` to ``tmp``, flush, rename to ``final``; folders made on demand."""
        try:
            try:
                self._write(tmp, view)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(tmp), mode=0o700, exist_ok=True)
                self._write(tmp, view)
            try:
                os.replace(tmp, final)
            except FileNotFoundError:  # first file in this shard: make it, try once more
                os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
                os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.dir_fsync:
            fsync_dir(os.path.dirname(final))
        return len(view)

    def _write(self, path: str, view: memoryview) -> None:
        direct = self.o_direct and page_aligned(view) and len(view) % codec.PAGE == 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o600)  # KV can reveal prompts: owner only
        try:
            done = 0
            while done < len(view):
                written = os.write(fd, view[done:])
                if written == 0:
                    raise OSError(errno.EIO, "write made no progress", path)
                done += written
            if self.fsync:
                os.fdatasync(fd)  # flushes the size too, which is all a reader needs
        finally:
            os.close(fd)

    def read_into(self, path: str, view: memoryview) -> int | None:
        """Read the file at ``path`` into the start of ``view``; ``None`` if it is absent.
        Raises ChunkTooLarge when it does not fit."""
        direct = self.o_direct and page_aligned(view)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > len(view):
                raise ChunkTooLarge(f"chunk file {os.path.basename(path)} has {size} bytes, "
                                    f"more than the {len(view)} given")
            if direct and size % codec.PAGE:  # O_DIRECT reads whole pages only
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~O_DIRECT)
            return read_fully(fd, view[:size])
        finally:
            os.close(fd)


def read_fully(fd: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], done)
        if got == 0:
            break
        done += got
    return done


def probe_o_direct(directory: str) -> bool:
    """Whether O_DIRECT opens and writes work here (older tmpfs, ramfs and FUSE refuse)."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f"probe.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    page = mmap.mmap(-1, codec.PAGE)  # anonymous maps are page aligned, as O_DIRECT needs
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            return os.write(fd, page) == codec.PAGE
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    finally:
        page.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def page_aligned(view: memoryview) -> bool:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % codec.PAGE == 0


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def listdir(path: str) -> list[os.DirEntry[str]]:
    """Entries of ``path``; an absent folder has none."""
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except FileNotFoundError:
        return []
