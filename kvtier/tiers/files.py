"""Chunk files, for the tiers that keep one file per chunk (``disk``, ``fs``).

A chunk is written under a unique temporary name, flushed and renamed into place, so a reader
sees either no file or a whole one, and two writers of one key (two servers on a shared mount)
never write into the same file. Reads and writes bypass the page cache with O_DIRECT where
the filesystem allows it and the buffer is page aligned (arena slots are).

Below the tier's root (the configuration's, trusted) every entry may have been made by
another writer of the folder, so nothing is taken on trust (docs/shared.md, "Hostile
entries"): each path is walked one folder at a time with ``O_NOFOLLOW`` (a link in place of a
folder is not ours, and its target is never listed, opened or deleted); files are opened with
``O_NONBLOCK`` (a FIFO would block ``open`` forever) and kept only when ``fstat`` says they are
regular; sizes are checked before anything is read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from kvtier import codec
from kvtier.config import ConfigStruct
from kvtier.errors import ChunkTooLarge, ConfigError, TierFull, TierIOError
from kvtier.tiers.base import Space

log = logging.getLogger(__name__)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
ENTRY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_A_FOLDER = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})
"""A part of a path that is missing, a file or a link: nothing of ours is there."""
_NOT_A_FILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.EISDIR})
"""Missing, a link (ELOOP under O_NOFOLLOW), a socket or device without a driver (ENXIO)."""


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


def choose_o_direct(options: FileOptions, folder: str, where: str, *,
                    shared: bool = False) -> bool:
    """Whether to use O_DIRECT in ``folder``: ``auto`` probes, ``on`` insists. A probe that
    fails for another reason than O_DIRECT (a full volume, a folder others made unwritable)
    is a ConfigError for a node's own tier; for a ``shared`` one, whose writers may cause
    it, a warning (``auto``: off; ``on``: on, as asked) and the start goes on."""
    if options.o_direct == "off":
        return False
    try:
        supported = probe_o_direct(folder)
    except OSError as exc:
        if not shared:
            raise ConfigError(f"{where}.path: cannot use {folder!r}: {exc}") from exc
        log.warning("%s.o_direct: cannot probe O_DIRECT in %r (%s); using %s", where,
                    folder, exc, options.o_direct)
        return options.o_direct == "on"
    if options.o_direct == "on" and not supported:
        raise ConfigError(f"{where}.o_direct: the filesystem of {folder!r} refuses O_DIRECT; "
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


# ---------------------------------------------------------------------- walking without links


def open_folder_at(dir_fd: int, name: str, *, create: bool = False) -> int | None:
    """The folder ``name`` in ``dir_fd``, opened without following a link; ``None`` where
    it is missing, a link or no folder. ``create`` makes a missing one, and replaces what
    holds its name that is no folder (a file, a link — the link itself, never its target —,
    a FIFO: :func:`_replace_with_folder`), so nothing a writer of the tier leaves there
    stops the tier's writes for good."""
    try:
        return os.open(name, FOLDER_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            return None
    except OSError as exc:
        if exc.errno not in _NOT_A_FOLDER:
            raise
        if not create:
            return None
    return _replace_with_folder(dir_fd, name)


MAKE_TRIES = 3
"""Tries to put a folder of ours in place of what holds its name (another writer may be
putting its entry back at the same time)."""


def _replace_with_folder(dir_fd: int, name: str) -> int:
    """Make the folder ``name`` in ``dir_fd``, first removing the entry of another kind
    that holds its name; a folder (another writer's, or one made meanwhile) is kept and
    opened. Raises ENOTDIR after ``MAKE_TRIES`` lost races."""
    for _ in range(MAKE_TRIES):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        try:
            return os.open(name, FOLDER_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno not in _NOT_A_FOLDER:
                raise
        if unlink_at(dir_fd, name):  # never a folder, never what a link points to
            _said_replaced(name)
    raise OSError(errno.ENOTDIR, "a link or a file keeps the name of a folder", name)


_SAID: set[str] = set()
"""Folder names whose replacement was logged (once per name and process: a writer that
keeps planting files must not flood the log)."""


def _said_replaced(name: str) -> None:
    if name not in _SAID and len(_SAID) < 64:
        _SAID.add(name)
        log.warning("an entry that is no folder held the name of the folder %.80r; it was "
                    "removed and the folder made (said once per name)", name)


def open_folder(root: str, parts: Sequence[str]) -> int | None:
    """``root/parts[0]/...`` as a folder fd, each part opened by :func:`open_folder_at`;
    ``None`` where one is missing, a link or no folder. ``root`` is the configuration's (it
    may be a link)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    return _walk(fd, parts, create=False)


def make_folder(root: str, parts: Sequence[str]) -> int:
    """:func:`open_folder`, making what is missing (the root too) and replacing what holds
    a folder's name below the root but is no folder (:func:`open_folder_at`)."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    fd = _walk(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parts, create=True)
    if fd is None:  # open_folder_at(create=True) raises instead
        raise OSError(errno.ENOTDIR, "not a folder", os.path.join(root, *parts))
    return fd


def _walk(fd: int, parts: Sequence[str], *, create: bool) -> int | None:
    """Open ``parts`` one below the other from the folder ``fd`` (which it closes)."""
    try:
        for part in parts:
            inner = open_folder_at(fd, part, create=create)
            os.close(fd)
            fd = -1
            if inner is None:
                return None
            fd = inner
        opened, fd = fd, -1
        return opened
    finally:
        if fd >= 0:
            os.close(fd)


def open_file_at(dir_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    """``name`` in ``dir_fd`` opened for reading, with its fstat, if it is a regular file;
    ``None`` for anything else (missing, a link, a FIFO, a socket, a device, a folder). The
    descriptor is still O_NONBLOCK: :func:`set_read_mode` before reading."""
    try:
        fd = os.open(name, ENTRY_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE:
            return None
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None
    return fd, info


def open_file(root: str, parts: Sequence[str]) -> tuple[int, os.stat_result] | None:
    """:func:`open_file_at` of ``root/parts...``, its folders walked without links."""
    folder = open_folder(root, parts[:-1])
    if folder is None:
        return None
    try:
        return open_file_at(folder, parts[-1])
    finally:
        os.close(folder)


def set_read_mode(fd: int, direct: bool) -> bool:
    """Drop O_NONBLOCK (some network filesystems heed it) and set O_DIRECT if asked and the
    file allows it; returns whether O_DIRECT is on."""
    if direct:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, O_DIRECT)
            return True
        except OSError as exc:
            if exc.errno not in _UNSUPPORTED:
                raise
    fcntl.fcntl(fd, fcntl.F_SETFL, 0)
    return False


def unlink_at(dir_fd: int, name: str) -> bool:
    """Remove the entry itself (a link, never what it points to); ``False`` when it is
    missing or a folder (never removed, let alone recursively)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except (FileNotFoundError, IsADirectoryError):
        return False
    return True


def unlink(root: str, parts: Sequence[str]) -> bool:
    """:func:`unlink_at` of ``root/parts...``, its folders walked without links."""
    folder = open_folder(root, parts[:-1])
    if folder is None:
        return False
    try:
        return unlink_at(folder, parts[-1])
    finally:
        os.close(folder)


def touch(root: str, parts: Sequence[str]) -> None:
    """Set the entry's mtime to now (a link's own, never its target's); missing: nothing."""
    folder = open_folder(root, parts[:-1])
    if folder is None:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.utime(parts[-1], dir_fd=folder, follow_symlinks=False)
    finally:
        os.close(folder)


class Entry(NamedTuple):
    """One entry of a folder, typed without following a link."""

    name: str
    kind: Literal["file", "folder", "other"]
    """``file``: a regular file; ``other``: a link, a FIFO, a socket, a device."""
    info: os.stat_result | None
    """Its own lstat, for files and others when asked."""


def entries_at(dir_fd: int, *, with_stat: bool = False) -> Iterator[Entry]:
    """The entries of the folder ``dir_fd`` (which must stay open while this runs);
    entries that vanish meanwhile are left out."""
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield Entry(entry.name, "folder", None)
                    continue
                kind: Literal["file", "other"] = (
                    "file" if entry.is_file(follow_symlinks=False) else "other")
                info = entry.stat(follow_symlinks=False) if with_stat else None
            except FileNotFoundError:
                continue
            yield Entry(entry.name, kind, info)


def entries(root: str, parts: Sequence[str], *, with_stat: bool = False) -> Iterator[Entry]:
    """:func:`entries_at` of ``root/parts...``; none where that is not a folder of ours."""
    folder = open_folder(root, parts)
    if folder is None:
        return
    try:
        yield from entries_at(folder, with_stat=with_stat)
    finally:
        os.close(folder)



# ---------------------------------------------------------------------- chunk files


@dataclass(frozen=True)
class FileIO:
    o_direct: bool
    fsync: bool
    dir_fsync: bool = False

    def write_atomic(self, root: str, final: Sequence[str], tmp: Sequence[str],
                     view: memoryview) -> int:
        """Write ``view`` to ``root/tmp...``, flush, rename to ``root/final...``; folders are
        made on demand, none is walked through a link."""
        tmp_dir = make_folder(root, tmp[:-1])
        try:
            self._write(tmp_dir, tmp[-1], view)
            try:
                final_dir = make_folder(root, final[:-1])
                try:
                    os.replace(tmp[-1], final[-1], src_dir_fd=tmp_dir, dst_dir_fd=final_dir)
                    if self.dir_fsync:
                        os.fsync(final_dir)
                finally:
                    os.close(final_dir)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp[-1], dir_fd=tmp_dir)
                raise
        finally:
            os.close(tmp_dir)
        return len(view)

    def _write(self, dir_fd: int, name: str, view: memoryview) -> None:
        direct = self.o_direct and page_aligned(view) and len(view) % codec.PAGE == 0
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                 | (O_DIRECT if direct else 0))
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)  # KV can reveal prompts: owner only
        try:
            done = 0
            while done < len(view):
                written = os.write(fd, view[done:])
                if written == 0:
                    raise OSError(errno.EIO, "write made no progress", name)
                done += written
            if self.fsync:
                os.fdatasync(fd)  # flushes the size too, which is all a reader needs
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)

    def read_into(self, root: str, parts: Sequence[str], view: memoryview) -> int | None:
        """Read the regular file ``root/parts...`` into the start of ``view``; ``None`` if
        there is none (or something else in its place). Raises ChunkTooLarge, from its size
        and before reading, when it does not fit."""
        opened = open_file(root, parts)
        if opened is None:
            return None
        fd, info = opened
        try:
            if info.st_size > len(view):
                raise ChunkTooLarge(f"chunk file {parts[-1]} has {info.st_size} bytes, "
                                    f"more than the {len(view)} given")
            # O_DIRECT reads whole pages only
            direct = self.o_direct and page_aligned(view) and info.st_size % codec.PAGE == 0
            set_read_mode(fd, direct)
            return read_fully(fd, view[: info.st_size])
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


def listdir(path: str) -> list[os.DirEntry[str]]:
    """Entries of ``path``; an absent folder has none. Follows links on the way: for
    trusted folders only (hostile ones: :func:`entries`)."""
    try:
        with os.scandir(path) as found:
            return list(found)
    except FileNotFoundError:
        return []
