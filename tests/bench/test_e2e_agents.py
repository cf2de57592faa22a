"""``kvtier bench agents`` through a real stack: one vLLM instance (CPU build, demo model,
float32) with its node server behind ``kvtier route``, as the benchmark starts it.

Three agent sessions of three turns, greedy with ``ignore_eos``, one request in flight (so
no answer depends on what it was batched with), played with retention on and then off: the
answers are the same tokens either way, the retention and release reached the node server
through the router, and later turns found their prefix in a cache.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvtier.bench.agents import NODE_PORT_OFFSET, STACK, measure
from kvtier.bench.agents_workload import AgentsConfig, build
from kvtier.bench.stacks import StackEnv, StartedConfig, get_stack
from kvtier.bench.tokens import counter_for
from kvtier.demo.model import DEMO_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install 'kvtier[vllm]')")]
ENGINE = ("--dtype", "float32", "--max-model-len", "4096", "--num-gpu-blocks-override", "33",
          "--enforce-eager", "--enable-prompt-tokens-details", "--seed", "0",
          "--kv-cache-memory-bytes", str(1 << 30))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: str) -> Iterator[StartedConfig]:
    env = StackEnv(model=demo_model, served_name=DEMO_NAME, engine_args=ENGINE,
                   workdir=tmp_path_factory.mktemp("kvtier-agents"), arena_bytes=16 << 20,
                   ready_timeout_s=400)
    started = get_stack(STACK).start(env)
    try:
        yield started
    finally:
        started.stop()


def _play(stack: StartedConfig, demo_model: str, retention: bool) -> dict[str, Any]:
    cfg = AgentsConfig(sessions=3, turns=3, system_prompt_tokens=64, context_tokens=1200,
                       tool_result_tokens=64, user_message_tokens=16, answer_tokens=8,
                       tool_call_share=0.5, time_scale=0.002, arrival_window_s=0.5, seed=3)
    counter = counter_for(demo_model)
    port = urlsplit(stack.url).port or 0
    node = f"http://127.0.0.1:{port + NODE_PORT_OFFSET}/metrics"
    return asyncio.run(measure(stack.url, DEMO_NAME, build(cfg, counter), retention, counter,
                               stack.metrics_urls, node, 300.0, max_in_flight=1))


def test_tokens_are_the_same_with_and_without_retention(stack: StartedConfig,
                                                        demo_model: str) -> None:
    on = _play(stack, demo_model, retention=True)
    off = _play(stack, demo_model, retention=False)
    for doc in (on, off):
        rows = doc["requests"]
        assert [r["error"] for r in rows] == [None] * 9, rows
        assert all(r["output_tokens"] == 8 for r in rows)
        assert all(r["backend"] for r in rows)  # through kvtier route
        assert all(r["cached_tokens"] >= 1024 for r in rows if r["turn"] > 0)
    assert [r["answer_sha256"] for r in on["requests"]] == \
        [r["answer_sha256"] for r in off["requests"]]
    assert len({r["answer_sha256"] for r in on["requests"]}) > 1  # real, varied answers
    assert on["node"]["releases"] > 0  # each session's end reached the store
    assert off["node"].get("releases", 0) == 0
    assert on["figures"]["all_count"] == 9
