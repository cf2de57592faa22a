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
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import secrets
from collections import deque

import numpy as np

from kvtier.errors import ConfigError, IntegrityError
from kvtier.processes import alive

SHM_DIR = "/dev/shm"


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
    """A process's mapping of an arena: the bytes only, no bookkeeping."""

    def __init__(self, name: str, num_slots: int, slot_bytes: int, *, create: bool,
                 prefault: bool = True) -> None:
        self.name = name
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        size = num_slots * slot_bytes
        path = shm_path(name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as exc:
            raise ConfigError(f"arena {name!r} already exists in {SHM_DIR}: another server "
                              "uses that name, or a dead one left it (remove the file)") from exc
        except FileNotFoundError as exc:
            raise ConfigError(f"arena {name!r} does not exist in {SHM_DIR}: is the server "
                              "running?") from exc
        try:
            info = os.fstat(fd)
            if create:
                os.ftruncate(fd, size)
            elif info.st_uid != os.getuid():
                raise ConfigError(f"arena {name!r} belongs to uid {info.st_uid}, not to us")
            elif info.st_size < size:
                raise ConfigError(f"arena {name!r} is smaller than {size} bytes")
            populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        except BaseException:
            os.close(fd)
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(self.name))


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


def default_name() -> str:
    """``kvtier-UID-PID-RANDOM``: the pid lets a later server remove it if this one dies."""
    return f"kvtier-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_stale() -> list[str]:
    """Unlink default-named arenas of this user whose server process is gone (a server
    killed with SIGKILL cannot unlink its own). Returns the names removed."""
    prefix = f"kvtier-{os.getuid()}-"
    removed = []
    for name in os.listdir(SHM_DIR):
        parts = name[len(prefix):].split("-")
        if not name.startswith(prefix) or len(parts) != 2 or not parts[0].isdigit():
            continue
        if alive(int(parts[0])):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if os.stat(shm_path(name)).st_uid == os.getuid():
                os.unlink(shm_path(name))
                removed.append(name)
    return removed
