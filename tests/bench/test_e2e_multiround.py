"""``kvtier bench multiround`` against ``kvtier serve`` on the demo model (vLLM CPU build).

Two users, two rounds, each user's history about 3000 tokens, a device cache of 40 blocks
(5120 tokens): round 1 of user 0 finds part of its prefix pushed out of vLLM's cache by user 1
and loads it from the arena. Streamed, per-request figures come from usage (cached tokens) and
the tiers from vLLM's counters; whole responses carry kvtier's per-tier accounting.
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.bench.multiround import Options, execute
from kvtier.bench.runner import LoadConfig
from kvtier.bench.workload import WorkloadConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install 'kvtier[vllm]')")]
ANSWER = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, demo_model: str) -> Iterator[str]:
    root = tmp_path_factory.mktemp("kvtier-multiround")
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtier", "serve", "--port", str(port), "--arena-size",
           "128MiB", "--disk-path", str(root / "disk"), "--disk-size", "1GiB",
           "--socket-path", str(root / "kvtier.sock"), "--dtype", "float32",
           "--max-model-len", "4096", "--num-gpu-blocks-override", "40",
           "--enable-prompt-tokens-details", "--log-file", "-"]
    log = root / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
                break
            except OSError:
                time.sleep(1.0)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _run(url: str, seed: int, stream: bool) -> dict[str, Any]:
    workload = WorkloadConfig(num_users=2, num_rounds=2, system_prompt_tokens=256,
                              user_history_tokens=3000, question_tokens=32,
                              answer_tokens=ANSWER, seed=seed)
    return execute(Options(url=url, model=None, workload=workload,
                           load=LoadConfig("closed", 1), stream=stream,
                           metrics_url=f"{url}/metrics"), progress=False)


def test_streamed_rounds_have_sane_figures_and_hit_in_round_two(served: str) -> None:
    doc = _run(served, seed=101, stream=True)
    reqs = doc["requests"]
    assert doc["tokenizer"].endswith("tokenizer.json")  # the demo model's own tokenizer
    assert [r["error"] for r in reqs] == [None] * 4
    for r in reqs:
        assert 0 < r["ttft_s"] <= r["e2e_s"] < 120
        assert r["output_tokens"] == ANSWER and 3000 < r["prompt_tokens"] < 4096
        assert r["kv_source"] == "cached_tokens"
    for r in (r for r in reqs if r["round"] == 1):
        assert r["kv_tokens"]["cached"] >= 2048  # its history came from a cache
    s = doc["summary"]
    assert s["requests_per_s"] > 0 and s["output_tok_s"] > 0
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
    # one gap per content chunk; the detokenizer may hold back a partial character, so a
    # chunk can carry two tokens of the demo model's random bytes
    assert 4 * (ANSWER - 1) // 2 <= s["itl_s"]["count"] <= 4 * (ANSWER - 1)
    endpoint = s["endpoint"]
    assert endpoint["prompt_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert endpoint["cached_tokens_by_source"].get("host", 0) > 0  # kvtier's arena
    assert 0 < s["kv"]["hit_ratio"] < 1


def test_whole_responses_say_which_tier_served_round_two(served: str) -> None:
    doc = _run(served, seed=202, stream=False)
    reqs = doc["requests"]
    assert all(r["kv_source"] == "kvtier" for r in reqs)
    for r in reqs:
        assert sum(r["kv_tokens"].values()) == r["prompt_tokens"]
    second = [r["kv_tokens"] for r in reqs if r["round"] == 1]
    assert all(t.get("device", 0) + t.get("arena", 0) >= 2048 for t in second)
    assert any(t.get("arena", 0) > 0 for t in second)  # pushed out of the device, reloaded
    assert doc["metrics"]["hit_ratio_arena"] > 0
