"""The LMCache case of ``kvtier bench ttft --lmcache``: the seed's own stack, same prompts.

LMCache's multi-process server and vLLM with ``LMCacheMPConnector`` run from LMCache's own
virtualenv (:mod:`kvtier.bench.peers`), started as the sweep's ``lmcache`` stack with the same
engine settings as the benchmark's in-process engines (dtype, ``--max-model-len``,
``--enforce-eager``, a 1 GiB KV cache, prefix caching, seed 0) and fed the very prompts the
kvtier cases used, as token ids. Per prompt: recompute (first sight), device (again, vLLM's
prefix cache), hit (after ``/reset_prefix_cache``: the KV comes from LMCache's server).

TTFT is the wall time of a ``max_tokens=1`` completion over HTTP, so it includes the HTTP
round trip that the in-process kvtier cases do not pay; ``lmcache_http_overhead_s`` (the
device hit over HTTP less the in-process one) estimates it.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.bench.stacks import StackEnv, get_stack

GiB = 1 << 30


def measure(model: str, dtype: str, max_model_len: int, prompts: list[list[int]],
            workdir: Path, ready_timeout_s: float = 900.0) -> dict[str, list[float]]:
    import httpx

    env = StackEnv(model=model, served_name="ttft", workdir=workdir,
                   engine_args=("--dtype", dtype, "--max-model-len", str(max_model_len),
                                "--enforce-eager", "--kv-cache-memory-bytes", str(GiB),
                                "--seed", "0"),
                   lmcache_l1_gb=1.0, ready_timeout_s=ready_timeout_s,
                   env={"VLLM_SERVER_DEV_MODE": "1"})  # enables POST /reset_prefix_cache
    stack = get_stack("lmcache").start(env)
    cases: dict[str, list[float]] = {"recompute": [], "device": [], "hit": []}
    try:
        with httpx.Client(base_url=stack.url, timeout=600) as http:
            def once(prompt: list[int]) -> float:
                body = {"model": "ttft", "prompt": prompt, "max_tokens": 1, "temperature": 0}
                start = time.perf_counter()
                http.post("/v1/completions", json=body).raise_for_status()
                return time.perf_counter() - start

            once(prompts[0][::-1])  # warm up (allocations); shares no prefix with the cases
            http.post("/reset_prefix_cache").raise_for_status()
            for prompt in prompts:
                cases["recompute"].append(once(prompt))
                cases["device"].append(once(prompt))
                http.post("/reset_prefix_cache").raise_for_status()
                cases["hit"].append(once(prompt))
    finally:
        stack.stop()
    return cases
