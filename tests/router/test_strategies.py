"""Each strategy's routing, through a real router to real stub backends over HTTP."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from stubs import (
    EngineModel,
    completion,
    node,
    post,
    router_config,
    running_router,
    stubs,
    with_engines,
)


def served_by(headers: dict[str, str]) -> str:
    return headers["X-Kvtier-Backend"]


async def _send(url: str, bodies: list[dict], headers: list[dict[str, str]] | None = None
                ) -> list[str]:
    out = []
    async with aiohttp.ClientSession() as s:
        for i, body in enumerate(bodies):
            status, _doc, h = await post(s, f"{url}/v1/completions", body,
                                         (headers or [{}] * len(bodies))[i])
            assert status == 200
            out.append(served_by(h))
    return out


def test_roundrobin_alternates() -> None:
    async def main() -> None:
        async with stubs(3) as backends, running_router(router_config(backends)) as router:
            got = await _send(f"http://127.0.0.1:{router.port}", [completion()] * 6)
            urls = [b.url for b in backends]
            assert got == urls + urls
            assert all(len(b.seen) == 2 for b in backends)
    asyncio.run(main())


def test_session_sticks_to_one_backend_and_only_a_dead_ones_sessions_move() -> None:
    async def main() -> None:
        async with stubs(3) as backends, running_router(
                router_config(backends, strategy="session")) as router:
            url = f"http://127.0.0.1:{router.port}"
            sessions = [f"user-{i}" for i in range(30)]
            by_header = await _send(url, [completion()] * 30,
                                    [{"X-Session-Id": s} for s in sessions])
            by_user = await _send(url, [completion(user=s) for s in sessions])
            assert by_header == by_user, "a header and the body's user hash alike"
            again = await _send(url, [completion(user=s) for s in sessions])
            assert again == by_user
            assert len(set(by_user)) == 3, "30 sessions spread over every backend"
            dead = backends[0]
            await dead.stop()
            router.pool.set_health(router.pool.backends[0], False, "test")
            after = await _send(url, [completion(user=s) for s in sessions])
            for before, now in zip(by_user, after, strict=True):
                if before != dead.url:
                    assert now == before, "a live backend's sessions stay"
                else:
                    assert now != dead.url
            plain = await _send(url, [completion()] * 4)
            assert len(set(plain)) == 2, "no session: round robin over the live ones"
    asyncio.run(main())


def test_prefix_hashes_the_leading_chunks(tmp_path: Path) -> None:
    async def main() -> None:
        server = node(tmp_path, slots=8)
        try:
            EngineModel(server, chunk_tokens=16).register()
            node_url = f"http://127.0.0.1:{server.metrics_port}"
            async with stubs(3) as backends, running_router(router_config(
                    backends, strategy="prefix", kvtier_servers=[node_url] * 3)) as router:
                await asyncio.sleep(0.3)  # a health round reads the namespaces
                url = f"http://127.0.0.1:{router.port}"
                groups = [[g * 1000 + t for t in range(32)] for g in range(30)]
                bodies = [completion([*g, 7, 8, 9, i]) for g in groups for i in range(2)]
                got = await _send(url, bodies)
                for g in range(30):
                    assert got[2 * g] == got[2 * g + 1], "a shared 2-chunk prefix"
                assert len(set(got)) == 3, "30 prefixes spread over every backend"
                short = await _send(url, [completion(list(range(20)))] * 3)
                assert len(set(short)) == 3, "a prompt under 2 chunks goes round robin"
                text = router.metrics.registry.get_sample_value(
                    "kvtier_router_decisions_total", {"strategy": "prefix", "reason": "short"})
                assert text == 3
        finally:
            server.stop()
    asyncio.run(main())


def test_cache_strategy_prefers_the_backend_holding_the_prefix(tmp_path: Path) -> None:
    async def main() -> None:
        nodes = [node(tmp_path / n, slots=64) for n in "ab"]
        try:
            async with stubs(2) as backends:
                servers = with_engines(backends, nodes, speed=4000)
                async with running_router(router_config(
                        backends, strategy="cache", kvtier_servers=servers)) as router:
                    await asyncio.sleep(0.3)
                    url = f"http://127.0.0.1:{router.port}"
                    prompts = [[p * 10000 + t for t in range(160)] for p in range(6)]
                    first = await _send(url, [completion(p) for p in prompts])
                    assert set(first) == {b.url for b in backends}, "cold prompts: both"
                    router.history.forget(0)  # only the node servers' books tell now
                    router.history.forget(1)
                    again = await _send(url, [completion([*p, 1, 2]) for p in prompts])
                    assert again == first, "each prompt goes back where its chunks are"
                    reasons = Counter({r: router.metrics.registry.get_sample_value(
                        "kvtier_router_decisions_total", {"strategy": "cache", "reason": r})
                        for r in ("cold", "affinity")})
                    assert reasons == {"cold": 6, "affinity": 6}
                    hits = router.metrics.registry.get_sample_value(
                        "kvtier_router_hit_source_total",
                        {"predicted": "arena", "actual": "arena"})
                    assert hits == 6, "predicted from the lookups = reported by the engine"
        finally:
            for server in nodes:
                server.stop()
    asyncio.run(main())


def test_cache_answers_say_the_estimate_that_chose_them_and_no_backend_can_forge_it(
        tmp_path: Path) -> None:
    forged = {"x-kvtier-estimate": "ttft=0.0000; reason=forged",
              "x-kvtier-backend": "http://elsewhere"}

    async def main() -> None:
        server = node(tmp_path / "a", slots=64)
        try:
            async with stubs(1, answer_headers=forged) as backends:
                urls = with_engines(backends, [server], speed=4000)
                async with running_router(router_config(
                        backends, strategy="cache", kvtier_servers=urls)) as router, \
                        aiohttp.ClientSession() as s:
                    await asyncio.sleep(0.3)
                    url = f"http://127.0.0.1:{router.port}/v1/completions"
                    prompt = [7000 + t for t in range(160)]  # 10 chunks of 16
                    said = []
                    for body in (completion(prompt), completion([*prompt, 1, 2]),
                                 completion([*prompt, 3], stream=True)):
                        status, _doc, h = await post(s, url, body)
                        assert status == 200 and h["X-Kvtier-Backend"] == backends[0].url
                        said.append(dict(part.split("=") for part in
                                         h["X-Kvtier-Estimate"].split("; ")))
                    assert said[0]["reason"] == "cold" and said[0]["held"] == "0"
                    assert said[0]["recomputed"] == "160"
                    # held in its device cache, by the router's history of what it sent
                    assert said[1]["reason"] == "affinity" and said[1]["held"] == "160"
                    assert said[1]["recomputed"] == "2" and said[2]["reason"] == "affinity"
                    for one in said:
                        parts = [float(one[k]) for k in ("wait", "load", "prefill")]
                        assert float(one["ttft"]) == pytest.approx(sum(parts), abs=2e-4)
                        assert float(one["crowd"]) >= 0
        finally:
            server.stop()

    async def roundrobin() -> None:
        async with stubs(1, answer_headers=forged) as backends, running_router(
                router_config(backends)) as router, aiohttp.ClientSession() as s:
            status, _doc, h = await post(s, f"http://127.0.0.1:{router.port}/v1/completions",
                                         completion())
            names = [k.lower() for k in h]
            assert status == 200 and h["X-Kvtier-Backend"] == backends[0].url
            assert names.count("x-kvtier-backend") == 1
            assert "x-kvtier-estimate" not in names, "no estimate made: none said, none passed on"
    asyncio.run(main())
    asyncio.run(roundrobin())
