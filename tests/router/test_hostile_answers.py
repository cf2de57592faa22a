"""A backend (or node server) that answers the router's health round with pages of any size.

The router reads each backend's ``/health`` and ``/v1/models`` and each node server's
``/v1/namespaces`` every round; a compromised or broken one may answer with megabytes. What the
router keeps of such answers is bounded (docs/security.md): a page over ``MAX_JSON_BYTES``
counts as no answer, a list of models is cut at ``MAX_MODELS``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from stubs import router_config, running_router

from kvtier.router.health import MAX_JSON_BYTES, MAX_MODELS


def models_page(count: int) -> bytes:
    return json.dumps({"object": "list", "data": [
        {"id": f"model-{i:07d}", "object": "model", "owned_by": "x" * 20}
        for i in range(count)]}).encode()


@asynccontextmanager
async def hostile(models: bytes) -> AsyncIterator[str]:
    """A backend that is healthy, lists ``models`` and names endless namespaces."""
    async def health(_: web.Request) -> web.Response:
        return web.Response(body=b"ok" * (1 << 20))  # 2 MiB where nothing is expected

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def listing(_: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def namespaces(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"[")
        item = json.dumps({"fingerprint": "ab" * 32, "model": "m"}).encode() + b","
        for _ in range((2 * MAX_JSON_BYTES) // len(item)):
            await resp.write(item)
        await resp.write(b"{}]")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", listing)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/namespaces", namespaces)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class _Backend:
    def __init__(self, url: str) -> None:
        self.url = url


def router_models(count: int, page: bytes | None = None) -> tuple[list[str], int]:
    """What the router's /v1/models lists, and how many namespaces it kept, for a backend
    listing ``count`` models (or answering ``page``)."""
    answer = models_page(count) if page is None else page

    async def main() -> tuple[list[str], int]:
        async with hostile(answer) as url, running_router(router_config(
                [_Backend(url)], kvtier_servers=[url])) as router, \
                aiohttp.ClientSession() as s:  # type: ignore[list-item]
            await asyncio.sleep(1.5)  # health rounds
            async with s.get(f"http://127.0.0.1:{router.port}/v1/models") as r:
                doc = await r.json()
            return [m["id"] for m in doc["data"]], len(router.pool.backends[0].namespaces)
    return asyncio.run(main())


def test_a_page_of_models_over_the_cap_counts_as_none() -> None:
    page = models_page(100_000)
    assert len(page) > MAX_JSON_BYTES
    models, namespaces = router_models(100_000)
    assert models == []
    assert namespaces == 0, "an endless /v1/namespaces is no answer either"


def test_a_long_list_of_models_is_cut() -> None:
    models, _ = router_models(5_000)
    assert len(models) == MAX_MODELS


def test_a_page_nested_deeper_than_the_parser_goes_counts_as_none() -> None:
    """``[[[[...`` under the size cap: json.loads raises RecursionError, which is no answer,
    not a health check that dies."""
    models, _ = router_models(0, b"[" * 200_000)
    assert models == []
