"""The CPU demo overlay's pod, run on this machine: its initContainer's command builds the
demo model, its vLLM container's command line (kvtier serve, the real vLLM CPU build) serves
it, and every probe of the pod is answered on the port it names; SIGTERM stops it within the
pod's grace period. Adapted only where a pod differs from a shared test machine: loopback
instead of 0.0.0.0, free ports instead of 8000/9477, temp folders for the volumes, a smaller
arena.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .kube import Container, containers, readme_secrets, render
from .pod_files import localize, make_files

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
PRESTOP_S = 10  # the vLLM container's preStop sleep, before SIGTERM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str, body: dict[str, Any] | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _adapted(argv: list[str], ports: dict[str, int]) -> list[str]:
    out = list(argv)
    swap = {"--host": "127.0.0.1", "--kvtier-metrics-host": "127.0.0.1",
            "--kvtier-advertise-host": "127.0.0.1", "--port": str(ports["http"]),
            "--kvtier-metrics-port": str(ports["kvtier"])}
    for i, arg in enumerate(out[:-1]):
        if arg in swap:
            out[i + 1] = swap[arg]
    return out


def _env(c: Container, root: Path) -> dict[str, str]:
    env = {k: localize([v], c, root)[0] for k, v in c.env(readme_secrets()).items()}
    env["KVTIER_ARENA_SIZE"] = "256MiB"  # the demo's 1GiB, on a machine shared by many
    return {**os.environ, **env}


def test_cpu_demo_pod_runs_here(tmp_path: Path) -> None:
    objects = render("overlays/cpu-demo")
    (init,) = [c for c in containers(objects) if c.init and c.owner["kind"] == "StatefulSet"]
    (vllm,) = [c for c in containers(objects) if c.spec["name"] == "vllm"]
    root = tmp_path / "pod"
    for c in (init, vllm):
        make_files(c, objects, root)
    config = root / "etc" / "kvtier" / "server.yaml"
    config.write_text(config.read_text().replace("/var/cache/kvtier", str(root / "var/cache")))

    build = localize(init.command_line(), init, root)
    assert build[0] == "python", build
    build[0] = sys.executable  # the image's python is the one kvtier is installed in
    built = subprocess.run(build, env=_env(init, root), capture_output=True, text=True,
                           timeout=600, check=False)
    assert built.returncode == 0, built.stderr[-3000:]

    ports = {"http": _free_port(), "kvtier": _free_port()}
    argv = _adapted(localize(vllm.command_line(readme_secrets()), vllm, root), ports)
    assert argv[:2] == ["kvtier", "serve"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", *argv[1:]], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(vllm, root))
    try:
        _probe_until_up(vllm, ports, proc, log)
        for name in PROBES:
            probe = vllm.spec[name]["httpGet"]
            url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
            assert _status(url) == 200, f"{name} {url}"
        answer = _status(f"http://127.0.0.1:{ports['http']}/v1/completions",
                         {"model": "kvtier-demo", "prompt": "hello", "max_tokens": 2})
        assert answer == 200
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        grace = vllm.pod["terminationGracePeriodSeconds"] - PRESTOP_S
        proc.wait(timeout=grace)
        assert proc.returncode == 0, log.read_text()[-3000:]
        assert time.monotonic() - started < grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _probe_until_up(c: Container, ports: dict[str, int], proc: subprocess.Popen[bytes],
                    log: Path) -> None:
    """As the kubelet does: the startup probe, every periodSeconds, failureThreshold times."""
    probe = c.spec["startupProbe"]
    url = f"http://127.0.0.1:{ports[probe['httpGet']['port']]}{probe['httpGet']['path']}"
    for _ in range(probe["failureThreshold"]):
        assert proc.poll() is None, log.read_text()[-3000:]
        if _status(url) == 200:
            return
        time.sleep(probe["periodSeconds"])
    raise AssertionError(f"the startup probe never passed: {log.read_text()[-3000:]}")
