"""The fs tier: the shared-tier suite on a local folder and on a real shared volume (a
SeaweedFS FUSE mount, which two servers' processes see as NFS clients would), plus what only
a POSIX folder has: temporary files of killed writers, and two processes on one folder."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import TierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.fs import FsTier
from kvtier.tiers.shared import SharedTier

from .conformance import NAMESPACE, key_of, read_back, sealed_chunk
from .shared_conformance import SharedTierConformance


def fs_tier(path: Path, name: str = "shared", **options: Any) -> FsTier:
    config = TierConfig(type="fs", name=name, capacity_bytes=1 << 30,
                        options={"path": str(path), **options})
    tier = FsTier.from_config(name, config)
    assert isinstance(tier, FsTier)
    return tier


class TestFsConformance(SharedTierConformance):
    def make_tier(self, tmp_path: Path) -> FsTier:
        return fs_tier(tmp_path / "shared")

    def make_peer(self, tier: SharedTier) -> SharedTier:
        assert isinstance(tier, FsTier)
        return fs_tier(Path(tier.root), name="peer")


@pytest.mark.services
class TestFsOnAFuseVolume(SharedTierConformance):
    """Two FUSE mounts of one SeaweedFS folder: two nodes' views of one shared volume."""

    @pytest.fixture(autouse=True)
    def _volume(self, make_seaweed_mount: Any) -> None:
        self.make_mount = make_seaweed_mount

    def make_tier(self, tmp_path: Path) -> FsTier:
        return fs_tier(Path(self.make_mount().path) / "kvtier")

    def make_peer(self, tier: SharedTier) -> SharedTier:
        return fs_tier(Path(self.make_mount().path) / "kvtier", name="peer")


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="poll_s must be positive"):
        fs_tier(tmp_path / "x", poll_s=0)
    with pytest.raises(ConfigError, match="pathh"):
        fs_tier(tmp_path / "x", pathh="typo")
    tier = fs_tier(tmp_path / "x", namespace_bytes="1GiB", journal_interval_s=0.1)
    assert tier.sharing.namespace_bytes == 1 << 30 and tier.sharing.journal_interval_s == 0.1


def test_a_killed_writer_leaves_no_chunk_and_its_temp_file_is_cleaned(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    tier = fs_tier(root)
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from tiers.conformance import key_of, sealed_chunk\n"
        "from kvtier.tiers.files import temp_name\n"
        "key = key_of('killed mid-write')\n"
        "data = sealed_chunk(key, 4 << 20)\n"
        f"path = os.path.join({str(root / 'tmp')!r}, temp_name(key.hex(), 'dead'))\n"
        "fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "os.write(fd, data[: len(data) // 2])\n"
        "print('half', flush=True)\n"
        "import time; time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "half"
    finally:
        proc.kill()
        proc.wait(10)
    key = key_of("killed mid-write")
    assert read_back(tier, key, 5 << 20) is None and list(tier.scan()) == []
    leftovers = os.listdir(root / "tmp")
    assert len(leftovers) == 1
    assert tier.clean_stale_temps(3600) == 0, "young: it could still be a write in flight"
    old = time.time() - 7200
    os.utime(root / "tmp" / leftovers[0], (old, old))
    assert tier.clean_stale_temps(3600) == 1 and os.listdir(root / "tmp") == []


def test_two_processes_share_one_folder(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    tier = fs_tier(root)
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from tiers.conformance import key_of, sealed_chunk\n"
        "from tiers.test_fs import fs_tier\n"
        f"tier = fs_tier(__import__('pathlib').Path({str(root)!r}), name='other')\n"
        "key = key_of('from another process')\n"
        "tier.write(key, sealed_chunk(key, seed=9))\n"
        "tier.put_note('servers/other', b'alive')\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    key = key_of("from another process")
    data = sealed_chunk(key, seed=9)
    assert read_back(tier, key, len(data)) == data
    assert tier.get_note("servers/other") == b"alive"
    assert [c.namespace for c in tier.scan()] == [NAMESPACE]
