"""``kvtier serve`` end to end: the OpenAI-compatible server with the connector, over HTTP.

One command starts vLLM on the demo model with the node server hosted by the serve process.
The terminal shows kvtier's short summary while vLLM logs to a file. A completion reports
where its prompt tokens came from; after vLLM's own cache is reset the same prompt is served
from the arena, and OpenAI's ``usage.prompt_tokens_details.cached_tokens`` counts it; both
/metrics endpoints show the connector's counters; stopping serve stops vLLM and frees the
arena.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from e2e import prompts

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROMPT = prompts([3000], seed=11)[0]


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    log: Path
    """vLLM's output and kvtier's log lines (--log-file)."""
    terminal: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def _post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        text = r.read().decode()
    return json.loads(text) if text.strip() else {}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, demo_model: str) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("kvtier-serve")
    port, metrics_port = _free_port(), _free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--port", str(port),
           "--arena-size", "128MiB", "--disk-path", str(root / "disk"), "--disk-size", "1GiB",
           "--socket-path", str(root / "kvtier.sock"), "--kvtier-metrics-port",
           str(metrics_port), "--enforce-eager", "--dtype", "float32",
           "--max-model-len", "10240", "--num-gpu-blocks-override", "96",
           "--log-file", str(root / "vllm.log")]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # enables POST /reset_prefix_cache
    terminal = root / "terminal.txt"
    with open(terminal, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, port, metrics_port, root / "vllm.log", terminal)
    try:
        _wait_ready(served)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_ready(served: Served, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert served.proc.poll() is None, served.terminal.read_text()[-3000:]
        if "Ctrl-C stops it" in served.terminal.read_text():
            _get(served.url("/v1/models"))
            return
        time.sleep(1.0)
    raise TimeoutError(served.terminal.read_text()[-3000:])


def _complete(served: Served, **params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "kvtier-demo", "prompt": PROMPT, "max_tokens": 8,
                            "temperature": 0.0}
    if params:
        body["kv_transfer_params"] = {"kvtier": params}
    return _post(served.url("/v1/completions"), body)


def test_the_terminal_shows_kvtiers_summary_and_vllm_logs_to_the_file(served: Served) -> None:
    out = served.terminal.read_text()
    assert len(out.strip().splitlines()) <= 8, out
    assert f"its log: {served.log}" in out
    assert f"at http://127.0.0.1:{served.port}/v1 (model 'kvtier-demo')" in out
    assert "tiers: arena 128 MiB (host RAM) -> disk 1 GiB in" in out
    assert f"node server: http://127.0.0.1:{served.metrics_port}" in out
    assert "INFO" not in out, "vLLM's and kvtier's log lines go to the file"
    log = served.log.read_text()
    assert "vllm" in log.lower() and "kvtier" in log


def test_completion_reports_where_its_tokens_came_from(served: Served) -> None:
    first = _complete(served, priority=80)
    acct = first["kv_transfer_params"]["kvtier"]
    assert acct["prompt_tokens"] == len(PROMPT) and acct["stored_chunks"] == 11
    assert acct["tokens"] == {"device": 0, "recomputed": len(PROMPT)}
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _post(served.url("/reset_prefix_cache"))
    again = _complete(served)
    tokens = again["kv_transfer_params"]["kvtier"]["tokens"]
    assert tokens["arena"] == 11 * 256 and sum(tokens.values()) == len(PROMPT)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # OpenAI's field counts kvtier's hits too (vLLM: device + connector tokens)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 11 * 256
    third = _complete(served)  # now vLLM's own prefix cache holds it: counted as well
    assert third["kv_transfer_params"]["kvtier"]["tokens"]["device"] == 2944
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 2944


def test_counters_reach_both_metrics_endpoints(served: Served) -> None:
    vllm_metrics = _get(served.url("/metrics"))
    assert 'vllm:kvtier_loaded_tokens_total{engine="0",model_name="kvtier-demo",tier="arena"}' \
        in vllm_metrics
    assert "vllm:kvtier_stored_chunks_total" in vllm_metrics
    server_metrics = _get(f"http://127.0.0.1:{served.metrics_port}/metrics")
    assert 'kvtier_hits_total{tier="arena"}' in server_metrics
    # ... and the connector's own counters, reported to the node server
    assert re.search(r'kvtier_engine_events_total\{client="vllm-[0-9a-f]{8}",'
                     r'event="loaded_tokens",tier="arena"\} [1-9]', server_metrics)


def test_stopping_serve_stops_vllm_and_frees_the_arena(served: Served) -> None:
    match = re.search(r"arena (kvtier-[A-Za-z0-9_.-]+)", served.log.read_text())
    assert match, "the serve process did not log its arena"
    arena = Path("/dev/shm") / match.group(1)
    assert arena.exists()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=60) in (0, 128 + signal.SIGTERM)
    assert "vLLM exited" in served.terminal.read_text()
    assert not arena.exists(), "the serve process did not free its arena"
