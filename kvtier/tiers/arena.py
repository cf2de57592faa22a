"""The host-RAM tier: one shared-memory region of fixed-size slots.

The region is a file in ``/dev/shm`` created once by the node server (mode 0600: only the same
user can map it) and mapped by engine processes, which copy KV straight into slots. Memory is
pre-faulted at creation: first touch of fresh pages is ~20x slower than a copy into touched
memory, so no page is touched for the first time on the data path.

Slot bookkeeping lives only in the server process::

    FREE ──alloc()──► WRITING ──publish()──► READY ──free()──► FREE
                         │                    ▲ │
                         └──────free()────────┘ └ lease()/unlease(): READY with leases > 0
                                                  cannot be freed

``WRITING`` covers both a client writing a new chunk and a lower tier reading one in.

Liveness: the creator holds an exclusive ``flock`` on the arena file from before its name is
usable until after its name is unlinked, and the kernel drops that lock when the owner dies, in
whatever PID namespace it ran. :func:`sweep_stale` removes an arena only if it can take the
lock, so servers of containers sharing ``/dev/shm`` (``--ipc=host``) never remove each other's
live arenas. Clients open and map the file but never ``flock`` it; closing their descriptors
cannot drop a lock held on the creator's open file description.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from collections import deque

import numpy as np

from kvtier.errors import ConfigError, IntegrityError

SHM_DIR = "/dev/shm"
LOCK_WAIT_S = 1.0
"""How long a new arena waits for a sweeper that locked it in the instant before its creator."""
CREATING_SUFFIX = ".creating"
CREATING_GRACE_S = 60.0
"""A creating name is used for microseconds; one older than this, unlocked, was left by a
creator killed in between and is swept."""
log = logging.getLogger("kvtier.server")


class SlotState(enum.IntEnum):
    FREE = 0
    WRITING = 1
    READY = 2


# Plain ints for the hot path: an IntEnum member lookup costs more than the whole state check.
_FREE, _WRITING, _READY = int(SlotState.FREE), int(SlotState.WRITING), int(SlotState.READY)


def shm_path(name: str) -> str:
    if "/" in name or name.startswith("."):
        raise ConfigError(f"arena name {name!r} must not contain '/' or start with '.'")
    return os.path.join(SHM_DIR, name)


class ArenaMapping:
    """A process's mapping of an arena: the bytes only, no bookkeeping.

    With ``create=True`` this process owns the arena: it holds the liveness lock until
    :meth:`unlink` (or until the object is collected or the process exits); :meth:`close` only
    unmaps, so the name is never unlocked while it still names this arena.
    """

    def __init__(self, name: str, num_slots: int, slot_bytes: int, *, create: bool,
                 prefault: bool = True) -> None:
        self.name = name
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._owned: tuple[int, int] | None = None  # (st_dev, st_ino) of the arena we created
        self._unlock: weakref.finalize | None = None
        size = num_slots * slot_bytes
        path = shm_path(name)
        fd = _create_locked(path) if create else _open_existing(path)
        try:
            info = os.fstat(fd)
            if create:
                os.ftruncate(fd, size)
            else:
                _check_attachable(name, info, size)
            populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            if create:
                _unlink_if_same(path, _identity(os.fstat(fd)))
            os.close(fd)
            raise
        if create:
            self._owned = _identity(info)
            self._unlock = weakref.finalize(self, os.close, fd)
        else:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_slots, slot_bytes)
        if create and prefault:
            self.array.fill(0)  # allocate every page now, not on the data path

    def slot(self, index: int) -> memoryview:
        """The whole slot ``index`` as a writable memoryview (no copy)."""
        start = index * self.slot_bytes
        return memoryview(self._mmap)[start : start + self.slot_bytes]

    def close(self) -> None:
        self.array = np.empty((0, 0), dtype=np.uint8)
        with contextlib.suppress(BufferError):
            self._mmap.close()

    def unlink(self) -> None:
        """Remove the name; an owner removes it only while it still names its own arena, and
        drops the liveness lock after, so no sweeper or new server can slip in between."""
        path = shm_path(self.name)
        if self._owned is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        _unlink_if_same(path, self._owned)
        if self._unlock is not None:
            self._unlock()


def _create_locked(path: str) -> int:
    """A new arena file at ``path``, exclusively locked before its name can be seen.

    The file is made under a private name (``<name>.creating``), locked there, and only then
    linked to ``path`` (which fails if ``path`` exists): a sweeper never sees the real name on
    an unlocked file, so it cannot take a fresh arena in the instant between its creation and
    its lock. A creating name outlives its creator only if it is killed in those microseconds;
    :func:`sweep_stale` removes such names once they are old and unlocked.
    """
    name = os.path.basename(path)
    creating = path + CREATING_SUFFIX
    try:
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError as exc:
        raise ConfigError(f"arena {name!r} is being created in {SHM_DIR} by another process "
                          f"({name}{CREATING_SUFFIX} exists)") from exc
    identity = _identity(os.fstat(fd))
    try:
        if not _lock(fd, LOCK_WAIT_S):  # only a sweep of an old creating name locks it
            raise ConfigError(f"arena {name!r} was held locked by another process while it "
                              "was being created; only its creating server may lock it")
        try:
            os.link(creating, path, follow_symlinks=False)
        except FileExistsError as exc:
            raise ConfigError(f"arena {name!r} already exists in {SHM_DIR}: another server "
                              "uses that name, or a dead one left it (remove the file)") from exc
    except BaseException:
        _unlink_if_same(creating, identity)
        os.close(fd)
        raise
    _unlink_if_same(creating, identity)
    return fd


def _lock(fd: int, wait_s: float) -> bool:
    """Take the exclusive lock on ``fd``, waiting at most ``wait_s`` (never forever: a
    same-user process could hold it on purpose)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) still names the file open as ``fd``."""
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return _identity(here) == _identity(os.fstat(fd))


def _unlink_if_same(path: str, identity: tuple[int, int]) -> None:
    """Unlink ``path`` only if it names the file ``identity`` (never one that replaced it)."""
    with contextlib.suppress(FileNotFoundError):
        if _identity(os.stat(path, follow_symlinks=False)) == identity:
            os.unlink(path)


def _open_existing(path: str) -> int:
    name = os.path.basename(path)
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise ConfigError(f"arena {name!r} does not exist in {SHM_DIR}: is the server "
                          "running?") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"arena {name!r} in {SHM_DIR} is a symbolic link; only the "
                              "regular file the server created is allowed") from exc
        raise


def _check_attachable(name: str, info: os.stat_result, size: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"arena {name!r} is not a regular file")
    if info.st_uid != os.getuid():
        raise ConfigError(f"arena {name!r} belongs to uid {info.st_uid}, not to us")
    if info.st_size < size:
        raise ConfigError(f"arena {name!r} is smaller than {size} bytes")


class Arena(ArenaMapping):
    """The server's arena: the mapping plus slot states, leases and the free list.

    States and lease counts are plain ``bytearray``/``list`` rather than numpy arrays: every
    chunk touches them a few times under the store lock, and a numpy scalar read or write
    costs several times a list index.
    """

    def __init__(self, name: str, num_slots: int, slot_bytes: int, *,
                 prefault: bool = True) -> None:
        super().__init__(name, num_slots, slot_bytes, create=True, prefault=prefault)
        self.state = bytearray(num_slots)  # all _FREE
        self.leases = [0] * num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A FREE slot, now WRITING; ``None`` when none is free."""
        if not self._free:
            return None
        index = self._free.popleft()
        self.state[index] = _WRITING
        return index

    def publish(self, index: int) -> None:
        if self.state[index] != _WRITING:
            self._unexpected(index, SlotState.WRITING)
        self.state[index] = _READY

    def free(self, index: int) -> None:
        if self.state[index] == _FREE:
            raise IntegrityError(f"slot {index} freed twice")
        if self.leases[index]:
            raise IntegrityError(f"slot {index} freed while leased {self.leases[index]} times")
        self.state[index] = _FREE
        self._free.append(index)

    def lease(self, index: int) -> None:
        if self.state[index] != _READY:
            self._unexpected(index, SlotState.READY)
        self.leases[index] += 1

    def unlease(self, index: int) -> None:
        if self.leases[index] <= 0:
            raise IntegrityError(f"slot {index} released more often than leased")
        self.leases[index] -= 1

    def _unexpected(self, index: int, state: SlotState) -> None:
        raise IntegrityError(
            f"slot {index} is {SlotState(self.state[index]).name}, expected {state.name}"
        )

    def check_integrity(self) -> None:
        """Free list and states agree; leases only on READY slots; no slot listed twice."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise IntegrityError("a slot appears twice in the free list")
        state = np.frombuffer(bytes(self.state), dtype=np.uint8)
        leases = np.asarray(self.leases, dtype=np.int64)
        states_free = set(np.flatnonzero(state == _FREE).tolist())
        if states_free != set(free):
            raise IntegrityError(
                f"free list has {len(free)} slots, state table says {len(states_free)}"
            )
        bad = np.flatnonzero((leases != 0) & (state != _READY))
        if bad.size:
            raise IntegrityError(f"slots {bad.tolist()[:8]} are leased but not READY")
        if (leases < 0).any():
            raise IntegrityError("negative lease count")


ARENA_PREFIX = "kvtier-arena-"
"""Default names are ``kvtier-arena-UID-PID-RANDOM``: the lock, not the pid, says whether the
owner lives (the pid is only for people, and is of the owner's own PID namespace)."""
_DEFAULT = re.compile(r"kvtier-arena-(\d+)-\d+-[0-9a-f]{8,32}")
_CREATING = re.compile(_DEFAULT.pattern + re.escape(CREATING_SUFFIX))
_LEGACY = re.compile(r"kvtier-(\d+)-\d+-[^-]+")
"""Names earlier kvtier versions gave arenas they never locked: kept (see :func:`sweep_stale`)."""


def default_name() -> str:
    """A fresh default name; only these are ever removed by :func:`sweep_stale`."""
    return f"{ARENA_PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"


def sweep_stale() -> list[str]:
    """Unlink this user's default-named arenas whose owner is gone (a server killed with
    SIGKILL cannot unlink its own). Returns the names removed.

    An arena is gone only if its lock can be taken now; a live owner in any PID namespace
    holds it. Arenas named by older kvtier versions carry no lock, and a pid in their name may
    be of another namespace, so nothing proves them dead: they are kept and logged.
    """
    uid = os.getuid()
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        match = _DEFAULT.fullmatch(name)
        if match and int(match.group(1)) == uid:
            if _remove_if_unlocked(shm_path(name), uid):
                removed.append(name)
            continue
        creating = _CREATING.fullmatch(name)
        if creating and int(creating.group(1)) == uid:
            if _remove_if_unlocked(shm_path(name), uid, older_than_s=CREATING_GRACE_S):
                removed.append(name)
            continue
        legacy = _LEGACY.fullmatch(name)
        if legacy and int(legacy.group(1)) == uid:
            log.warning("kept arena %s/%s: an older kvtier made it without a lock, so whether "
                        "its server lives is unknown; remove it by hand once no older kvtier "
                        "server runs", SHM_DIR, name)
    return removed


def _remove_if_unlocked(path: str, uid: int, *, older_than_s: float = 0.0) -> bool:
    """Lock the regular file at ``path`` (never through a link), and unlink it while holding
    the lock if the name still names that file: no owner can take it back in between. With
    ``older_than_s``, a file modified more recently is kept."""
    try:
        info = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return False
        if older_than_s and time.time() - info.st_mtime < older_than_s:
            return False
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # gone already, a link, or not ours to open
    try:
        if _identity(os.fstat(fd)) != _identity(info):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives
        if not _names(path, fd):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
