"""DiskTier: the conformance suite twice (O_DIRECT where possible, and buffered), then what
only a filesystem does: restarts, leftovers, corruption on disk, bad options, a full disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import ConfigError, CorruptChunkError, TierFull
from kvtier.keys import ChunkKey
from kvtier.tiers.disk import DiskTier

from .conformance import (
    NAMESPACE,
    LowerTierConformance,
    key_of,
    page_buffer,
    read_back,
    sealed_chunk,
)


def disk_tier(path: Path, name: str = "disk", **options: object) -> DiskTier:
    config = TierConfig(type="disk", capacity_bytes=1 << 30,
                        options={"path": str(path), **options})
    tier = DiskTier.from_config(name, config)
    assert isinstance(tier, DiskTier)
    return tier


class TestDiskConformance(LowerTierConformance):
    def make_tier(self, tmp_path: Path) -> DiskTier:
        return disk_tier(tmp_path / "disk")


class TestBufferedDiskConformance(LowerTierConformance):
    def make_tier(self, tmp_path: Path) -> DiskTier:
        return disk_tier(tmp_path / "disk", o_direct="off", fsync=False, dir_fsync=True)


@contextlib.contextmanager
def mounted(fstype: str, where: Path, options: str = "") -> Iterator[Path]:
    """A fresh filesystem at ``where``; skips the test where mounting is not permitted."""
    where.mkdir()
    command = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if result.returncode:
        pytest.skip(f"cannot mount {fstype}: {result.stderr.strip() or result.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def chunk_file(tier: DiskTier, hexkey: str) -> Path:
    return Path(tier.root, "chunks", hexkey[:2], hexkey[2:4], f"{hexkey}.kvc")


def test_layout_names_files_by_key_hex_only(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    key = key_of("layout")
    data = sealed_chunk(key)
    tier.write(key, data)
    path = chunk_file(tier, key.hex())
    assert path.stat().st_size == len(data)
    assert path.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path / "disk" / "tmp") == []
    facts = tier.describe()
    assert facts["path"] == str(tmp_path / "disk") and facts["fsync"] is True
    assert facts["o_direct"] in (True, False)
    with pytest.raises(ValueError, match="32 bytes"):
        tier.read_into(ChunkKey(key[:8]), page_buffer(len(data)), namespace=NAMESPACE)


def test_restart_rebuilds_the_same_index(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    for i in range(5):
        key = key_of(f"restart {i}")
        tier.write(key, sealed_chunk(key, (i + 1) * 3000, priority=20 + i))
    before = sorted(tier.scan(), key=lambda c: c.key)
    tier.close()
    again = disk_tier(tmp_path / "disk", o_direct="off")
    assert sorted(again.scan(), key=lambda c: c.key) == before
    got = read_back(again, key_of("restart 4"), 64 * codec.PAGE)
    assert got is not None


def test_scan_removes_leftover_temp_files(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    key = key_of("kept")
    tier.write(key, sealed_chunk(key))
    tmp = tmp_path / "disk" / "tmp"
    dead = [f"{key.hex()}.host.2147483647.0a1b.tmp", f"{key.hex()}.host.{os.getpid()}.0a1b.tmp",
            f"{key.hex()}.2147483647.0a1b.tmp", "junk"]
    live = f"{key.hex()}.host.{os.getppid()}.0a1b.tmp"  # our parent is alive: a write in flight
    for name in [*dead, live]:
        (tmp / name).write_bytes(b"half a chunk")
    assert [c.key for c in tier.scan()] == [key]
    assert os.listdir(tmp) == [live]


def test_a_flipped_payload_byte_fails_verification(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    key = key_of("bit rot")
    data = sealed_chunk(key)
    tier.write(key, data)
    with open(chunk_file(tier, key.hex()), "r+b") as f:
        f.seek(codec.HEADER_SIZE + 100)
        byte = f.read(1)[0]
        f.seek(codec.HEADER_SIZE + 100)
        f.write(bytes([byte ^ 0x40]))
    dst = page_buffer(len(data))
    assert tier.read_into(key, dst, namespace=NAMESPACE) == len(data)
    with pytest.raises(CorruptChunkError, match="payload checksum"):
        codec.verify(dst, key)


def test_scan_quarantines_whatever_is_not_a_chunk(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    good, other, short = key_of("good"), key_of("other"), key_of("short")
    tier.write(good, sealed_chunk(good))
    tier.write(short, sealed_chunk(short))
    chunks = tmp_path / "disk" / "chunks"
    good_file = chunk_file(tier, good.hex())
    os.truncate(chunk_file(tier, short.hex()), codec.HEADER_SIZE + 100)
    chunk_file(tier, other.hex()).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(good_file, chunk_file(tier, other.hex()))  # a header for a different key
    (chunks / "zz").write_bytes(b"not a shard")
    (chunks / good.hex()[:2] / "file-not-dir").write_bytes(b"")
    (good_file.parent / "hello.kvc").write_bytes(b"bad name")
    (good_file.parent / f"{'0' * 64}.kvc").write_bytes(b"right name, wrong shard")
    (good_file.parent / f"{key_of('x').hex()}.kvc").symlink_to(good_file)
    assert [c.key for c in tier.scan()] == [good]
    assert len(os.listdir(tmp_path / "disk" / "quarantine")) == 7
    assert tier.read_into(other, page_buffer(64 * codec.PAGE), namespace=NAMESPACE) is None
    assert [c.key for c in tier.scan()] == [good]
    assert len(os.listdir(tmp_path / "disk" / "quarantine")) == 7


@pytest.mark.parametrize(("options", "message"), [
    ({"pathh": "x"}, "tiers[0].options.pathh: unknown key"),
    ({"o_direct": "maybe"}, "tiers[0].options.o_direct"),
    ({"fsync": "yes"}, "tiers[0].options.fsync"),
    ({"dir_fsync": 1}, "tiers[0].options.dir_fsync"),
    ({"path": ""}, "tiers[0].options.path"),
])
def test_bad_options_are_config_errors(tmp_path: Path, options: dict[str, object],
                                       message: str) -> None:
    config = TierConfig(type="disk", capacity_bytes=1 << 20,
                        options={"path": str(tmp_path), **options})
    with pytest.raises(ConfigError) as info:
        DiskTier.from_config("tiers[0]", config)
    assert str(info.value).startswith(message)


def test_path_is_required_and_must_be_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="path"):
        DiskTier.from_config("disk", TierConfig(type="disk", capacity_bytes=1, options={}))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"disk\.options\.path: cannot use"):
        disk_tier(tmp_path / "file")


def test_o_direct_auto_falls_back_where_the_filesystem_refuses_it(tmp_path: Path) -> None:
    with mounted("ramfs", tmp_path / "ramfs") as mnt:  # ramfs has no O_DIRECT
        tier = disk_tier(mnt / "disk", o_direct="auto")
        assert tier.describe()["o_direct"] is False
        key = key_of("ramfs")
        tier.write(key, sealed_chunk(key))
        assert read_back(tier, key, 64 * codec.PAGE) is not None
        with pytest.raises(ConfigError, match=r"o_direct: .* refuses O_DIRECT"):
            disk_tier(mnt / "disk", o_direct="on")


def test_o_direct_on_round_trips_where_supported(tmp_path: Path) -> None:
    if not disk_tier(tmp_path / "probe").o_direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    tier = disk_tier(tmp_path / "disk", o_direct="on")
    key = key_of("direct")
    data = sealed_chunk(key, 1 << 20)
    tier.write(key, data)
    assert read_back(tier, key, len(data)) == data


def test_a_full_disk_raises_tier_full_and_leaves_nothing_behind(tmp_path: Path) -> None:
    with mounted("tmpfs", tmp_path / "small", "size=256k") as mnt:
        tier = disk_tier(mnt / "disk")
        small, big = key_of("fits"), key_of("too big")
        tier.write(small, sealed_chunk(small, 8 * codec.PAGE))
        with pytest.raises(TierFull) as info:
            tier.write(big, sealed_chunk(big, 1 << 20))
        assert isinstance(info.value, OSError) and isinstance(info.value.__cause__, OSError)
        assert os.listdir(mnt / "disk" / "tmp") == []
        assert tier.read_into(big, page_buffer(2 << 20), namespace=NAMESPACE) is None
        assert [c.key for c in tier.scan()] == [small]
        tier.write(big, sealed_chunk(big, 32 * codec.PAGE))  # space freed: usable again
        tier.close()


# ---------------------------------------------------------------------- hostile entries


def _within(call: Callable[[], object], fifo: Path, seconds: float = 5.0) -> object:
    """``call()``'s result, failing (not hanging) when it blocks; opens the FIFO's writing
    end afterwards so a stuck reader goes on."""
    out: dict[str, object] = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for {seconds}s on the FIFO {fifo.name}")
    return out.get("value")


def test_a_fifo_chunk_is_a_miss_and_a_scan_moves_it_without_opening_it(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    good, fifo_key = key_of("good"), key_of("fifo")
    tier.write(good, sealed_chunk(good))
    fifo = chunk_file(tier, fifo_key.hex())
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    assert _within(lambda: tier.read_into(fifo_key, page_buffer(1 << 20),
                                          namespace=NAMESPACE), fifo) is None
    assert _within(lambda: [c.key for c in tier.scan()], fifo) == [good]
    assert not fifo.exists() and tier.skipped_entries == 1
    os.mkfifo(tmp_path / "disk" / "tmp" / "stuck.tmp")  # a FIFO among the temporaries
    assert _within(lambda: [c.key for c in tier.scan()], fifo) == [good]
    assert os.listdir(tmp_path / "disk" / "tmp") == []


def test_linked_shards_and_temps_are_never_followed(tmp_path: Path) -> None:
    tier = disk_tier(tmp_path / "disk")
    good, victim = key_of("good"), key_of("elsewhere")
    tier.write(good, sealed_chunk(good))
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = outside / victim.hex()[2:4] / f"{victim.hex()}.kvc"
    planted.parent.mkdir()
    shutil.copyfile(chunk_file(tier, good.hex()), planted)
    (outside / "precious").write_bytes(b"not the tier's")
    top = tmp_path / "disk" / "chunks" / victim.hex()[:2]
    if top.exists():
        pytest.skip("the two keys share a shard")
    top.symlink_to(outside, target_is_directory=True)
    (tmp_path / "disk" / "tmp" / "dead.host.2147483647.0a1b.tmp").symlink_to(
        outside / "precious")

    assert tier.read_into(victim, page_buffer(1 << 20), namespace=NAMESPACE) is None
    tier.delete(victim, namespace=NAMESPACE)
    tier.quarantine(victim, namespace=NAMESPACE)
    assert [c.key for c in tier.scan()] == [good]
    assert planted.exists() and (outside / "precious").read_bytes() == b"not the tier's"
    assert not top.is_symlink(), "the link itself was moved to quarantine"
    moved = os.listdir(tmp_path / "disk" / "quarantine")
    assert len(moved) == 1 and (tmp_path / "disk" / "quarantine" / moved[0]).is_symlink()
    assert os.listdir(tmp_path / "disk" / "tmp") == []
    tier.write(victim, sealed_chunk(victim))  # a real shard folder now
    assert read_back(tier, victim, 1 << 20) is not None and planted.exists()
