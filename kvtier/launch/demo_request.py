"""``kvtier serve --demo-request``: show the cache at work once vLLM is up, then stop.

Sends one long prompt (the demo corpus, twice over), resets vLLM's own prefix cache (the
dev-mode ``/reset_prefix_cache`` endpoint, enabled for this run only), sends it again, and
prints where each request's prompt tokens came from, from the response's
``kv_transfer_params`` (and vLLM's ``usage.prompt_tokens_details.cached_tokens``). Exit
status 0 when the second request was served from kvtier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.httpjson import post_json

DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""What vLLM needs in its environment for ``/reset_prefix_cache``."""


def demonstrate(base: str, model: str) -> int:
    from kvtier.demo.model import corpus_text

    prompt = corpus_text() * 2
    first, t1 = _timed(lambda: _complete(base, model, prompt))
    post_json(f"{base}/reset_prefix_cache", {})
    second, t2 = _timed(lambda: _complete(base, model, prompt))
    a, b = _acct(first), _acct(second)
    print(f"\nkvtier demo: a {a.get('prompt_tokens', '?')}-token prompt sent twice, vLLM's own "
          "prefix cache reset in between")
    print(f"  1st request {t1:6.2f} s  {_where(a)}; stored {a.get('stored_chunks', 0)} chunks")
    print(f"  2nd request {t2:6.2f} s  {_where(b)}; vLLM's cached_tokens "
          f"{_cached(second)}\n", flush=True)
    return 0 if b.get("tokens", {}).get("arena", 0) > 0 else 1


def _where(acct: dict[str, Any]) -> str:
    tokens = acct.get("tokens") or {}
    parts = [f"{name} {count}" for name, count in tokens.items() if count]
    return "prompt tokens: " + (", ".join(parts) if parts else "(no kvtier accounting)")


def _acct(response: dict[str, Any]) -> dict[str, Any]:
    params = response.get("kv_transfer_params") or {}
    return dict(params.get("kvtier") or {})


def _cached(response: dict[str, Any]) -> object:
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens", "?")


def _timed(fn: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _complete(base: str, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    return dict(post_json(f"{base}/v1/completions", body))
