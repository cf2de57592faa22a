"""Health checks take a dead backend out and bring it back; an attempt that failed before a
byte reached the client is retried elsewhere; a backend killed under traffic costs at most
the requests that were mid-stream on it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from stubs import StubBackend, completion, post, router_config, running_router, stubs


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def test_a_dead_backend_goes_out_and_comes_back() -> None:
    async def main() -> None:
        async with stubs(2) as backends, running_router(router_config(backends)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            first = router.pool.backends[0]
            assert first.healthy
            await backends[0].stop()
            await wait_for(lambda: not first.healthy)
            got = [(await post(s, url, completion()))[2]["X-Kvtier-Backend"] for _ in range(4)]
            assert got == [backends[1].url] * 4
            up = router.metrics.registry.get_sample_value("kvtier_router_backend_up",
                                                          {"backend": backends[0].url})
            assert up == 0
            await backends[0].start()  # same port
            await wait_for(lambda: first.healthy)
            got = [(await post(s, url, completion()))[2]["X-Kvtier-Backend"] for _ in range(4)]
            assert set(got) == {b.url for b in backends}
    asyncio.run(main())


def test_a_request_that_failed_before_any_byte_is_retried_elsewhere() -> None:
    async def main() -> None:
        async with stubs(3) as backends, running_router(
                router_config(backends, health_interval_s=60)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            await backends[0].stop()  # the router does not know yet: no check for 60 s
            await backends[1].stop()
            assert all(b.healthy for b in router.pool)
            for stream in (False, True):
                status, doc, headers = await post(s, url, completion(stream=stream))
                assert status == 200 and headers["X-Kvtier-Backend"] == backends[2].url
            retries = sum(router.metrics.registry.get_sample_value(
                "kvtier_router_retries_total", {"backend": b.url}) or 0 for b in backends)
            assert retries == 2, "each dead backend tried once, then taken out"
            assert [b.healthy for b in router.pool] == [False, False, True]
            await backends[2].stop()
            status, doc, _ = await post(s, url, completion())
            assert status == 502 and "1 backends failed" in doc["error"]["message"]
            status, doc, _ = await post(s, url, completion())
            assert status == 503, "nobody left"
    asyncio.run(main())


def test_a_backend_dying_before_its_first_streamed_byte_is_replaced() -> None:
    async def main() -> None:
        hang = await StubBackend(hang_first_byte=True).start()
        good = await StubBackend().start()
        try:
            async with running_router(router_config([hang, good], health_interval_s=60)
                                      ) as router, aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                task = asyncio.create_task(post(s, url, completion(stream=True)))
                await wait_for(lambda: hang.seen)  # it has the request, sent headers only
                await hang.stop()
                status, doc, headers = await task
                assert status == 200 and headers["X-Kvtier-Backend"] == good.url
                assert "data: [DONE]" in doc
        finally:
            await good.stop()
    asyncio.run(main())


def test_traffic_continues_when_a_backend_is_killed_mid_test() -> None:
    async def main() -> None:
        async with stubs(3, tokens=6, token_s=0.04, ttft_s=0.005) as backends, running_router(
                router_config(backends, health_interval_s=0.5)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            results: list[tuple[float, bool]] = []
            stop = time.monotonic() + 3.0

            async def client(i: int) -> None:
                while time.monotonic() < stop:
                    body = completion(stream=i % 2 == 0)
                    try:
                        async with s.post(url, json=body) as resp:
                            text = await resp.text()
                            ok = resp.status == 200 and (
                                not body["stream"] or text.rstrip().endswith("[DONE]"))
                    except aiohttp.ClientError:
                        ok = False
                    results.append((time.monotonic(), ok))

            async def killer() -> None:
                await asyncio.sleep(1.0)
                await backends[0].kill()

            await asyncio.gather(*(client(i) for i in range(6)), killer())
            failed = [t for t, ok in results if not ok]
            print(f"\n{len(results)} requests, {len(failed)} failed (streams cut by the kill)")
            assert len(results) > 50
            assert len(failed) <= 6, "only requests in flight on the killed backend"
            if failed:
                first = min(failed)
                later = [t for t in failed if t > first + 0.1]
                assert later == [], "no failed request after the first error"
            assert not router.pool.backends[0].healthy
    asyncio.run(main())


def test_a_request_finding_no_backend_up_waits_for_one_that_comes_back() -> None:
    """An instance the stack just restarted answers its /health before the router's next
    round: a request that finds every backend out checks them at once and waits (bounded)
    instead of failing with 503."""
    async def main() -> None:
        async with stubs(1) as backends, running_router(
                router_config(backends, health_interval_s=60, no_backend_wait_s=5)
                ) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            await backends[0].stop()
            status, _, _ = await post(s, url, completion())  # finds it dead: 502, out
            assert status == 502 and not router.pool.backends[0].healthy
            started = time.monotonic()
            status, _, _ = await post(s, url, completion())
            waited = time.monotonic() - started
            assert status == 503 and 4.5 <= waited < 30, f"answered after {waited:.1f} s"
            await backends[0].start()  # back on the same port; no round for 60 s
            status, doc, headers = await post(s, url, completion())
            assert status == 200 and headers["X-Kvtier-Backend"] == backends[0].url, doc
            assert router.pool.backends[0].healthy
    asyncio.run(main())


def test_without_a_wait_a_request_finding_no_backend_up_is_answered_at_once() -> None:
    async def main() -> None:
        async with stubs(1) as backends, running_router(
                router_config(backends, health_interval_s=60, no_backend_wait_s=0)
                ) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            await backends[0].stop()
            await post(s, url, completion())
            await backends[0].start()  # back, but nobody checks before the next round
            started = time.monotonic()
            status, _, _ = await post(s, url, completion())
            assert status == 503 and time.monotonic() - started < 2
    asyncio.run(main())
