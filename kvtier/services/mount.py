"""A SeaweedFS filer mounted with FUSE (``weed mount``): the stand-in for a shared NFS volume.

Two mounts of one filer, or two processes on one mount, see the same files, with atomic
rename, ``O_EXCL`` and ``flock``. Teardown is SIGTERM (weed unmounts itself through fusermount)
and then ``umount`` / ``fusermount -u`` in case it could not; a mount whose process was killed
(:meth:`kill`) answers ENOTCONN until then.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvtier.errors import ServiceStartError
from kvtier.services.base import Service
from kvtier.services.binaries import WEED, find_binary
from kvtier.services.mounts import check_fuse, is_mounted, mounts, unmount

FSTYPE = "fuse.seaweedfs"


class SeaweedMount(Service):
    """``weed mount`` of ``filer_address`` (``SeaweedFS.filer_address``) on ``path``."""

    kind = "mount"

    def __init__(self, filer_address: str, *, mountpoint: Path | None = None,
                 filer_path: str = "/", cache_capacity_mb: int = 256,
                 workdir: Path | None = None, extra_args: Sequence[str] = (),
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 10.0,
                 die_with_parent: bool = True) -> None:
        super().__init__(workdir=workdir, start_timeout_s=start_timeout_s,
                         stop_timeout_s=stop_timeout_s, die_with_parent=die_with_parent)
        self.filer_address = filer_address
        self.path = Path(mountpoint) if mountpoint is not None else self.workdir / "mnt"
        self.filer_path = filer_path
        self.cache_capacity_mb = cache_capacity_mb
        self.extra_args = list(extra_args)

    @property
    def mounted(self) -> bool:
        return is_mounted(self.path)

    def _before_start(self) -> None:
        check_fuse()
        for sub in ("cache", "logs", "tmp"):
            (self.workdir / sub).mkdir(exist_ok=True)
        if self.mounted and not unmount(self.path, lazy=True):  # left by a killed weed mount
            raise ServiceStartError(f"{self.path} is still mounted and cannot be unmounted")
        self.path.mkdir(parents=True, exist_ok=True)

    def _command(self) -> list[str]:
        w = self.workdir
        return [
            find_binary(WEED), f"-logdir={w / 'logs'}", "mount",
            f"-filer={self.filer_address}", f"-filer.path={self.filer_path}",
            f"-dir={self.path}", f"-cacheDir={w / 'cache'}",
            f"-cacheCapacityMB={self.cache_capacity_mb}", f"-localSocket={w / 'mount.sock'}",
            *self.extra_args,
        ]

    def _environment(self) -> Mapping[str, str]:
        return {**os.environ, "TMPDIR": str(self.workdir / "tmp")}

    def _answers(self) -> bool:
        return mounts().get(str(self.path)) == FSTYPE and _stat_within(self.path, 2.0)

    def _where(self) -> str:
        return f"{self.path} (filer {self.filer_address})"

    def _after_stop(self) -> None:
        if self.mounted and not unmount(self.path, timeout_s=self.stop_timeout_s):
            unmount(self.path, lazy=True)  # busy: detach now, the kernel frees it when idle


def _stat_within(path: Path, timeout_s: float) -> bool:
    """Whether ``os.stat(path)`` returns in time; a stat on a stuck mount would block, so it
    runs in a daemon thread that is abandoned (and unblocked by the unmount) if it does."""
    done = threading.Event()

    def probe() -> None:
        try:
            os.stat(path)
        except OSError:
            return
        done.set()

    threading.Thread(target=probe, name=f"stat {path}", daemon=True).start()
    return done.wait(timeout_s)
