"""Which code and machine made a benchmark's numbers: the commit of the checkout (else the
version), and the machine (:func:`machine`).

A figure read months later, or next to another made on another day, is only comparable when
it says what ran and where; a results file records :func:`provenance` beside its command
line.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvtier.version import __version__

GIT_TIMEOUT_S = 20.0
"""Also the limit of the one ``nvidia-smi`` call."""


def provenance(where: Path | None = None) -> dict[str, Any]:
    """Which code made the numbers: the commit of the git checkout kvtier runs from (and
    whether it had changes not committed), else only the package's version. An installed
    copy (in ``site-packages``) has no commit, even inside some other checkout."""
    where = where or Path(__file__).resolve().parent
    installed = "site-packages" in where.parts or "dist-packages" in where.parts
    commit = None if installed else _git(where, "rev-parse", "HEAD")
    dirty = None
    if commit is not None:
        changes = _git(where, "--no-optional-locks", "status", "--porcelain",
                       "--untracked-files=no")
        dirty = None if changes is None else bool(changes)
    return {"commit": commit, "dirty": dirty, "kvtier_version": __version__}


def _git(where: Path, *argv: str) -> str | None:
    try:
        done = subprocess.run(["git", *argv], cwd=where, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine() -> dict[str, Any]:
    """Which machine made the numbers: host name, platform, CPU model and count, memory and,
    where ``nvidia-smi`` answers, the GPUs."""
    return {"host": platform.node(), "platform": platform.platform(),
            "cpu": _cpu_model(), "cpus": os.cpu_count(), "memory_bytes": _memory(),
            "gpus": _gpus()}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] or None
