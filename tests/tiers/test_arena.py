"""The arena: slot states and leases, integrity checks, and the /dev/shm file other processes
map. Every arena gets a unique name and is unlinked in teardown."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import ConfigError, IntegrityError
from kvtier.tiers.arena import Arena, ArenaMapping, SlotState, shm_path

SLOTS, SLOT_BYTES = 4, 8192
_names = itertools.count()


def unique_name() -> str:
    return f"kvtier-test-arena-{os.getpid()}-{next(_names)}"


@pytest.fixture
def arena() -> Iterator[Arena]:
    arena = Arena(unique_name(), SLOTS, SLOT_BYTES)
    try:
        yield arena
        arena.check_integrity()
    finally:
        arena.close()
        arena.unlink()


def test_a_slot_goes_free_writing_ready_free(arena: Arena) -> None:
    slot = arena.alloc()
    assert slot is not None and arena.state[slot] == SlotState.WRITING
    assert arena.free_slots == SLOTS - 1
    arena.publish(slot)
    assert arena.state[slot] == SlotState.READY
    arena.lease(slot)
    arena.lease(slot)
    arena.unlease(slot)
    arena.unlease(slot)
    arena.free(slot)
    assert arena.state[slot] == SlotState.FREE and arena.free_slots == SLOTS


def test_a_failed_write_frees_its_slot(arena: Arena) -> None:
    slot = arena.alloc()
    assert slot is not None
    arena.free(slot)  # rollback straight from WRITING
    assert arena.free_slots == SLOTS


def test_exhaustion_returns_none_until_a_slot_is_freed(arena: Arena) -> None:
    slots = [arena.alloc() for _ in range(SLOTS)]
    assert sorted(s for s in slots if s is not None) == list(range(SLOTS))
    assert arena.alloc() is None
    arena.free(2)
    assert arena.alloc() == 2


def test_double_free_is_an_integrity_error(arena: Arena) -> None:
    slot = arena.alloc()
    assert slot is not None
    arena.free(slot)
    with pytest.raises(IntegrityError, match="freed twice"):
        arena.free(slot)


def test_free_while_leased_is_an_integrity_error(arena: Arena) -> None:
    slot = arena.alloc()
    assert slot is not None
    arena.publish(slot)
    arena.lease(slot)
    with pytest.raises(IntegrityError, match="while leased"):
        arena.free(slot)
    arena.unlease(slot)
    arena.free(slot)


@pytest.mark.parametrize("published", [False, True])
def test_publish_needs_a_writing_slot(arena: Arena, published: bool) -> None:
    if published:
        slot = arena.alloc()
        assert slot is not None
        arena.publish(slot)
    else:
        slot = 0  # still FREE
    with pytest.raises(IntegrityError, match="expected WRITING"):
        arena.publish(slot)


def test_lease_and_unlease_misuse(arena: Arena) -> None:
    slot = arena.alloc()
    assert slot is not None
    with pytest.raises(IntegrityError, match="expected READY"):
        arena.lease(slot)
    with pytest.raises(IntegrityError, match="more often than leased"):
        arena.unlease(slot)


def test_check_integrity_sees_a_slot_listed_twice(arena: Arena) -> None:
    arena._free.append(arena._free[0])
    with pytest.raises(IntegrityError, match="twice"):
        arena.check_integrity()
    arena._free.pop()


def test_check_integrity_sees_a_leaked_slot(arena: Arena) -> None:
    leaked = arena._free.pop()  # FREE in the state table, missing from the free list
    with pytest.raises(IntegrityError, match="free list"):
        arena.check_integrity()
    arena._free.append(leaked)


def test_check_integrity_sees_a_lease_on_a_slot_not_ready(arena: Arena) -> None:
    arena.leases[1] = 1
    with pytest.raises(IntegrityError, match="leased but not READY"):
        arena.check_integrity()
    arena.leases[1] = 0


def test_the_shm_file_is_private_to_its_user(arena: Arena) -> None:
    info = os.stat(shm_path(arena.name))
    assert info.st_mode & 0o777 == 0o600
    assert info.st_size == SLOTS * SLOT_BYTES


def test_another_process_writes_a_slot_the_server_reads(arena: Arena) -> None:
    child = (
        "import sys, numpy as np\n"
        "from kvtier.tiers.arena import ArenaMapping\n"
        "m = ArenaMapping(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), create=False)\n"
        "m.slot(2)[:] = (np.arange(m.slot_bytes) % 251).astype(np.uint8).tobytes()\n"
        "m.close()\n"
    )
    subprocess.run([sys.executable, "-c", child, arena.name, str(SLOTS), str(SLOT_BYTES)],
                   check=True, timeout=60)
    expected = (np.arange(SLOT_BYTES) % 251).astype(np.uint8)
    assert np.array_equal(arena.array[2], expected)
    assert not arena.array[[0, 1, 3]].any()


def test_attaching_to_a_missing_or_small_arena_fails(arena: Arena) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        ArenaMapping(unique_name(), SLOTS, SLOT_BYTES, create=False)
    with pytest.raises(ConfigError, match="smaller than"):
        ArenaMapping(arena.name, SLOTS + 1, SLOT_BYTES, create=False)


def test_creating_an_existing_arena_fails_and_keeps_it(arena: Arena) -> None:
    arena.slot(0)[:4] = b"mine"
    with pytest.raises(ConfigError, match="already exists"):
        Arena(arena.name, SLOTS, SLOT_BYTES)
    assert os.path.exists(shm_path(arena.name))
    assert bytes(arena.slot(0)[:4]) == b"mine"


def test_unlink_removes_the_file() -> None:
    arena = Arena(unique_name(), SLOTS, SLOT_BYTES, prefault=False)
    path = shm_path(arena.name)
    try:
        assert os.path.exists(path)
    finally:
        arena.close()
        arena.unlink()
    assert not os.path.exists(path)
    arena.unlink()  # a second unlink is harmless


def test_names_cannot_leave_dev_shm() -> None:
    for bad in ("../etc/x", "a/b", ".hidden"):
        with pytest.raises(ConfigError, match="must not contain"):
            shm_path(bad)


def test_a_link_in_place_of_an_arena_is_never_followed(arena: Arena, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(bytes(SLOTS * SLOT_BYTES))
    name = unique_name()
    os.symlink(target, shm_path(name))
    try:
        with pytest.raises(ConfigError, match="symbolic link"):
            ArenaMapping(name, SLOTS, SLOT_BYTES, create=False)
        with pytest.raises(ConfigError, match="already exists"):
            Arena(name, SLOTS, SLOT_BYTES, prefault=False)
        assert target.read_bytes() == bytes(SLOTS * SLOT_BYTES)
    finally:
        os.unlink(shm_path(name))


def test_an_owner_never_unlinks_a_file_that_replaced_its_arena() -> None:
    arena = Arena(unique_name(), SLOTS, SLOT_BYTES, prefault=False)
    path = shm_path(arena.name)
    try:
        os.unlink(path)  # someone removed it, and someone else took the name
        Path(path).write_bytes(b"theirs")
        arena.close()
        arena.unlink()
        assert Path(path).read_bytes() == b"theirs"
    finally:
        os.unlink(path)
