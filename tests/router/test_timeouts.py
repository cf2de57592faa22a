"""A backend slower than --request-timeout-s is not taken for dead: the request is not sent
to another backend (it would be generated twice), the client gets a 504, the backend stays
in. Only a timeout while connecting (nothing was sent) is retried elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import aiohttp
from stubs import StubBackend, completion, post, router_config, running_router, stubs


def _timeouts(router: object, url: str) -> float:
    registry = router.metrics.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("kvtier_router_timeouts_total", {"backend": url}) or 0.0


def test_a_slow_whole_answer_is_a_504_sent_once_and_the_backend_stays_in() -> None:
    async def main() -> None:
        async with stubs(3, ttft_s=1.0) as backends, running_router(
                router_config(backends, health_interval_s=60, request_timeout_s=0.3)
                ) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            status, doc, headers = await post(s, url, completion())
            assert status == 504, doc
            assert "timed out" in doc["error"]["message"]
            sent = [len(b.seen) for b in backends]
            assert sorted(sent) == [0, 0, 1], f"sent to one backend only, not {sent}"
            assert all(b.healthy for b in router.pool), "a slow backend is not down"
            served = backends[sent.index(1)].url
            assert headers["X-Kvtier-Backend"] == served
            assert _timeouts(router, served) == 1
            retries = [router.metrics.registry.get_sample_value(
                "kvtier_router_retries_total", {"backend": b.url}) or 0 for b in backends]
            assert retries == [0, 0, 0]
    asyncio.run(main())


def test_a_stream_silent_before_its_first_byte_is_a_504_and_not_retried() -> None:
    async def main() -> None:
        hang = await StubBackend(hang_first_byte=True).start()
        good = await StubBackend().start()
        try:
            async with running_router(router_config([hang, good], health_interval_s=60,
                                                    request_timeout_s=0.3)) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                status, doc, _ = await post(s, url, completion(stream=True))
                assert len(hang.seen) == 1 and status == 504, (status, doc)
                assert good.seen == [], "not generated a second time elsewhere"
                assert all(b.healthy for b in router.pool)
        finally:
            await hang.stop()
            await good.stop()
    asyncio.run(main())


def test_a_stream_that_stalls_mid_way_is_cut_but_the_backend_stays_in() -> None:
    async def main() -> None:
        async with stubs(1, tokens=3, token_s=1.0) as backends, running_router(
                router_config(backends, health_interval_s=60, request_timeout_s=0.3)
                ) as router, aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            got = b""
            async with s.post(url, json=completion(stream=True)) as resp:
                status = resp.status
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    while chunk := await resp.content.readany():
                        got += chunk
            text = got.decode()
            assert status == 200 and "w0" in text and "[DONE]" not in text
            assert '"code": 504' in text, text
            assert router.pool.backends[0].healthy
            assert _timeouts(router, backends[0].url) == 1
    asyncio.run(main())


def _full_listener(port: int) -> tuple[socket.socket, list[socket.socket]]:
    """A listener on ``port`` that never accepts, its one-slot backlog full: new SYNs are
    dropped, so connecting to it times out."""
    full = socket.socket()
    full.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    full.bind(("127.0.0.1", port))
    full.listen(0)
    fillers = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    return full, fillers


def test_a_timeout_while_connecting_is_retried_elsewhere() -> None:
    async def main() -> None:
        async with stubs(2) as backends, running_router(router_config(
                backends, health_interval_s=60, connect_timeout_s=0.3,
                request_timeout_s=5.0)) as router, aiohttp.ClientSession() as s:
            silent, good = backends
            await silent.stop()  # both checked in; no check again for 60 s
            full, fillers = _full_listener(int(silent.url.rsplit(":", 1)[1]))
            try:
                await asyncio.sleep(0.1)
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                status, _, headers = await post(s, url, completion())  # roundrobin: silent
                assert status == 200 and headers["X-Kvtier-Backend"] == good.url
                retried = router.metrics.registry.get_sample_value(
                    "kvtier_router_retries_total", {"backend": silent.url})
                assert retried == 1
                assert router.pool.backends[0].healthy, "a connect timeout is not a refusal"
            finally:
                for c in fillers:
                    c.close()
                full.close()
    asyncio.run(main())
