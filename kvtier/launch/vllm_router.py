"""Where the ``vllm-router`` executable is, for ``kvtier serve --router vllm-router``.

vllm-router (PyPI, vLLM's Rust router) is never a kvtier dependency, and ``kvtier serve``
never installs it: that is ``kvtier bench peers --install vllm-router``
(:mod:`kvtier.bench.peers`), which puts it in its own virtualenv, :func:`vllm_router_venv`.
The stack looks, in order, at

1. ``--vllm-router PATH``,
2. ``$KVTIER_VLLM_ROUTER``,
3. that virtualenv's ``bin/vllm-router``,
4. ``vllm-router`` on ``$PATH``,

and fails before anything starts when none is an executable file, saying how to install it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvtier.errors import ConfigError

ENV = "KVTIER_VLLM_ROUTER"
INSTALL = "kvtier bench peers --install vllm-router"


def vllm_router_venv() -> Path:
    """The virtualenv ``kvtier bench peers --install vllm-router`` creates (under the cache
    directory, ``$KVTIER_CACHE_DIR``, default ``~/.cache/kvtier``)."""
    from kvtier.demo.model import default_cache_dir

    return default_cache_dir() / "peers" / "vllm-router-venv"


def vllm_router_binary(venv: Path | None = None) -> Path:
    """The executable inside ``venv`` (default :func:`vllm_router_venv`), present or not."""
    return (venv or vllm_router_venv()) / "bin" / "vllm-router"


def find_vllm_router(explicit: str | None = None) -> Path:
    """The vllm-router to run; :class:`ConfigError` naming what was tried and how to install
    it when there is none. A path given explicitly (option or environment) must work: it is
    never passed over for another one."""
    given = explicit or os.environ.get(ENV)
    if given:
        path = Path(given).expanduser()
        if not _executable(path):
            source = "--vllm-router" if explicit else f"${ENV}"
            raise ConfigError(f"{source}: {given!r} is not an executable file; give the "
                              f"vllm-router executable, or install one with: {INSTALL}")
        return path.absolute()
    venv = vllm_router_binary()
    if _executable(venv):
        return venv
    on_path = shutil.which("vllm-router")
    if on_path:
        return Path(on_path)
    raise ConfigError(f"--router vllm-router: no vllm-router found (not in {venv}, not on "
                      f"PATH); install it with: {INSTALL}, or give --vllm-router PATH or "
                      f"${ENV}")


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
