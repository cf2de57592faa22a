"""Evicting files from the page cache, so a benchmark reads the device, not RAM."""

from __future__ import annotations

import os
from pathlib import Path


def evict(folder: Path) -> None:
    """Flush and drop every file under ``folder`` from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
