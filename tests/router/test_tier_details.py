"""What a tenant without tier details learns of the cache from an answer: nothing.

The hostile tenant (``may_see_tier_details: false``) asks through the real router, whole and
streamed, on both endpoints, with every usage option vLLM offers, and looks for any field
that says how many of its prompt tokens were cached: ``kv_transfer_params.kvtier`` and
``usage.prompt_tokens_details.cached_tokens`` (which ``kvtier serve`` enables and vLLM fills
from kvtier's hits). The stub backend answers as vLLM does; a tenant allowed to see details
gets them all (docs/router.md, "Tenants"; docs/security.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from stubs import MODEL, completion, router_config, running_router, stubs

from kvtier.router.tenants import load_tenants

KEY_A = "alice-key-0123456789abcdef"
KEY_B = "bob-key-fedcba9876543210"
CACHED = 96


def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {
        "alice": {"api_keys": [KEY_A], "may_see_tier_details": True},
        "bob": {"api_keys": [KEY_B]}}}))
    path.chmod(0o600)
    return path


def body(endpoint: str, mode: str) -> dict[str, Any]:
    if endpoint == "chat":
        out: dict[str, Any] = {"model": MODEL, "max_tokens": 4,
                               "messages": [{"role": "user", "content": "hello"}]}
    else:
        out = completion()
    if mode != "whole":
        out["stream"] = True
        out["stream_options"] = {"include_usage": True,
                                 "continuous_usage_stats": mode == "continuous"}
    return out


def documents(text: str, mode: str) -> list[dict[str, Any]]:
    """The answer's JSON documents: the body, or every event of the stream (each whole)."""
    if mode == "whole":
        return [json.loads(text)]
    events = [line[5:] for line in text.split("\n") if line.startswith("data:")]
    assert events[-1].strip() == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def cached_of(doc: dict[str, Any]) -> int | None:
    details = (doc.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


@pytest.mark.parametrize("mode", ["whole", "stream", "continuous"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_tenant_without_tier_details_learns_no_cached_tokens(
        tmp_path: Path, endpoint: str, mode: str) -> None:
    tenants = load_tenants(str(tenants_file(tmp_path)), None, None)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"

    async def main() -> None:
        async with stubs(1, cached_tokens=CACHED, stream_details=True, tokens=3) as backends, \
                running_router(router_config(backends, tenants=tenants)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}{path}"
            answers = {}
            for key in (KEY_A, KEY_B):
                headers = {"Authorization": f"Bearer {key}"}
                async with s.post(url, json=body(endpoint, mode), headers=headers) as r:
                    assert r.status == 200
                    answers[key] = documents((await r.read()).decode(), mode)
            seen_by_a = [cached_of(d) for d in answers[KEY_A] if d.get("usage")]
            assert seen_by_a and set(seen_by_a) == {CACHED}, "A sees what was cached"
            with_usage = [d for d in answers[KEY_B] if d.get("usage")]
            assert len(with_usage) == len(seen_by_a), "B keeps its usage ..."
            for doc in with_usage:
                assert cached_of(doc) is None, "... without cached_tokens"
                assert doc["usage"]["prompt_tokens_details"] is None
                assert doc["usage"]["completion_tokens"] >= 1
            for doc in answers[KEY_B]:
                assert "kvtier" not in json.dumps(doc.get("kv_transfer_params"))
            text = json.dumps(answers[KEY_B])
            assert "cached_tokens" not in text
    asyncio.run(main())
