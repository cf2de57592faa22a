"""``kvtier serve --demo-request``: start the server, show the cache at work, stop.

Sends one long prompt (the demo corpus, twice over), resets vLLM's own prefix cache (the
dev-mode ``/reset_prefix_cache`` endpoint, enabled for this run only), sends it again, and
prints where each request's prompt tokens came from, from the response's
``kv_transfer_params``. Exit status 0 when the second request was served from kvtier.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.vllm.sizing import flag_value

READY_TIMEOUT_S = 900.0


def run_demo(cmd: list[str], env: dict[str, str], vllm_args: Sequence[str],
             preexec: Callable[[], None]) -> int:
    port = flag_value(vllm_args, "--port") or "8000"
    host = flag_value(vllm_args, "--host") or "127.0.0.1"
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    child = subprocess.Popen(cmd, env={**env, "VLLM_SERVER_DEV_MODE": "1"}, preexec_fn=preexec)
    try:
        model = _wait_ready(base, child)
        if model is None:
            print("kvtier serve: vLLM did not come up", file=sys.stderr)
            return 1
        return _demonstrate(base, model)
    finally:
        _stop(child)


def _demonstrate(base: str, model: str) -> int:
    from kvtier.demo.model import corpus_text

    prompt = corpus_text() * 2
    first, t1 = _timed(lambda: _complete(base, model, prompt))
    _post(f"{base}/reset_prefix_cache", {})
    second, t2 = _timed(lambda: _complete(base, model, prompt))
    a, b = _acct(first), _acct(second)
    print(f"\nkvtier demo: a {a.get('prompt_tokens', '?')}-token prompt sent twice, vLLM's own "
          "prefix cache reset in between")
    print(f"  1st request {t1:6.2f} s  {_where(a)}; stored {a.get('stored_chunks', 0)} chunks")
    print(f"  2nd request {t2:6.2f} s  {_where(b)}\n", flush=True)
    return 0 if b.get("tokens", {}).get("arena", 0) > 0 else 1


def _where(acct: dict[str, Any]) -> str:
    tokens = acct.get("tokens") or {}
    parts = [f"{name} {count}" for name, count in tokens.items() if count]
    return "prompt tokens: " + (", ".join(parts) if parts else "(no kvtier accounting)")


def _acct(response: dict[str, Any]) -> dict[str, Any]:
    params = response.get("kv_transfer_params") or {}
    return dict(params.get("kvtier") or {})


def _timed(fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _complete(base: str, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    return _post(f"{base}/v1/completions", body)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip() else {}


def _wait_ready(base: str, child: subprocess.Popen[bytes]) -> str | None:
    """The served model's name once vLLM answers; None if it exited or never answered."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and child.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as resp:
                return str(json.load(resp)["data"][0]["id"])
        except (OSError, urllib.error.URLError, KeyError, IndexError, ValueError):
            time.sleep(1.0)
    return None


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
