"""Streams pass through chunk by chunk, their first chunk within a few ms of a direct call;
errors pass through with their status and body; /v1/models is merged; /metrics counts."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time

import aiohttp
from stubs import MODEL, StubBackend, completion, post, router_config, running_router, stubs


async def timed_stream(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, list[float]]:
    """Seconds to the first chunk, and each chunk's arrival after the first."""
    start = time.perf_counter()
    arrivals: list[float] = []
    async with s.post(url, json=body) as resp:
        assert resp.status == 200
        async for _chunk in resp.content.iter_any():
            arrivals.append(time.perf_counter())
    return arrivals[0] - start, [t - arrivals[0] for t in arrivals]


def test_streaming_first_chunk_is_within_a_few_ms_of_a_direct_call() -> None:
    async def main() -> None:
        async with stubs(1, tokens=3, ttft_s=0.0, token_s=0.0) as backends, running_router(
                router_config(backends)) as router, aiohttp.ClientSession() as s:
            body = completion(stream=True)
            direct_url = f"{backends[0].url}/v1/completions"
            routed_url = f"http://127.0.0.1:{router.port}/v1/completions"
            for url in (direct_url, routed_url):  # warm the connections
                await timed_stream(s, url, body)
            direct, routed = [], []
            for _ in range(40):
                direct.append((await timed_stream(s, direct_url, body))[0])
                routed.append((await timed_stream(s, routed_url, body))[0])
            d, r = statistics.median(direct), statistics.median(routed)
            print(f"\nfirst chunk: direct {d * 1e3:.2f} ms, through the router {r * 1e3:.2f} ms "
                  f"(+{(r - d) * 1e3:.2f} ms, p90 +{(_p90(routed) - _p90(direct)) * 1e3:.2f})")
            assert r - d < 0.050
    asyncio.run(main())


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def test_chunks_arrive_as_the_backend_sends_them() -> None:
    async def main() -> None:
        async with stubs(1, tokens=5, token_s=0.15) as backends, running_router(
                router_config(backends)) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            _, after_first = await timed_stream(s, url, completion(stream=True))
            # 5 token events 0.15 s apart (+ [DONE]): nothing held back until the end
            assert len(after_first) >= 4
            gaps = [b - a for a, b in itertools.pairwise(after_first)]
            assert sum(1 for g in gaps if g > 0.1) >= 3, gaps
    asyncio.run(main())


def test_backend_errors_pass_through_with_their_status_and_body() -> None:
    async def main() -> None:
        bad = await StubBackend(status=400).start()
        try:
            async with running_router(router_config([bad])) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                for stream in (False, True):
                    status, doc, _ = await post(s, url, completion(stream=stream))
                    assert status == 400 and doc == {"error": {"message": "stub says 400",
                                                               "code": 400}}
                assert router.pool.backends[0].healthy, "an error answer is not a dead backend"
                async with s.post(url, data=b"{not json",
                                  headers={"Content-Type": "application/json"}) as resp:
                    # forwarded as is: the stub fails on it, and its 500 comes back
                    assert resp.status == 500 and resp.headers["X-Kvtier-Backend"] == bad.url
        finally:
            await bad.stop()
    asyncio.run(main())


def test_models_are_merged_and_metrics_count_per_backend() -> None:
    async def main() -> None:
        async with stubs(2) as backends, running_router(router_config(backends)) as router, \
                aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{router.port}"
            async with s.get(f"{base}/v1/models") as resp:
                models = await resp.json()
            assert [m["id"] for m in models["data"]] == [MODEL], "one model, both backends"
            for stream in (False, True, False, True):
                await post(s, f"{base}/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "stream": stream})
            async with s.get(f"{base}/metrics") as resp:
                text = await resp.text()
            for b in backends:
                assert (f'kvtier_router_requests_total{{backend="{b.url}",endpoint="chat",'
                        f'status="200"}} 2.0') in text
                assert f'kvtier_router_request_seconds_count{{backend="{b.url}",endpoint="chat"}}' \
                    in text
            assert 'kvtier_router_decisions_total{reason="turn",strategy="roundrobin"} 4.0' in text
            async with s.get(f"{base}/health") as resp:
                assert resp.status == 200 and (await resp.json())["backends_up"] == 2
            assert json.dumps(models)  # a JSON document
    asyncio.run(main())


def test_a_client_that_goes_away_mid_stream_frees_the_backend() -> None:
    async def main() -> None:
        async with stubs(1, tokens=100, token_s=0.02) as backends, running_router(
                router_config(backends)) as router:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            async with aiohttp.ClientSession() as s, \
                    s.post(url, json=completion(stream=True)) as resp:
                await resp.content.readany()
            started = time.monotonic()  # the client's connection is closed now
            while router.active or backends[0].running:
                assert time.monotonic() - started < 2.0, "the stream went on without a client"
                await asyncio.sleep(0.02)
            assert router.pool.backends[0].healthy, "a client leaving is not a backend failing"
            assert router.pool.backends[0].load.in_flight == 0
    asyncio.run(main())
