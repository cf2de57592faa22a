"""Routing around the dead, as the stack needs it: a whole answer cut by a backend that died
under it is sent to another backend (the client never sees it); ``/kvtier/backends`` lists
who is behind the router and whether each is in rotation (``kvtier verify --url`` reads it);
``--parts-file`` shows the stack's parts in ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from stubs import completion, post, router_config, running_router, stubs

from kvtier.verify.discover import discover


async def wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def test_a_whole_answer_cut_by_a_dying_backend_is_served_by_another() -> None:
    async def main() -> None:
        async with stubs(2, ttft_s=0.5) as backends, running_router(
                router_config(backends, health_interval_s=60)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            # roundrobin: the first request goes to backend 0, which dies while prefilling
            task = asyncio.create_task(post(s, url, completion()))
            await wait_for(lambda: backends[0].running == 1)
            await backends[0].kill()
            status, doc, headers = await task
            assert status == 200, doc
            assert headers["X-Kvtier-Backend"] == backends[1].url
            assert [b.healthy for b in router.pool] == [False, True], \
                "out on its first connection error, before any health check"
            retries = router.metrics.registry.get_sample_value(
                "kvtier_router_retries_total", {"backend": backends[0].url})
            assert retries == 1
    asyncio.run(main())


def test_the_router_lists_its_backends_and_their_node_servers() -> None:
    async def main() -> None:
        async with stubs(2) as backends:
            nodes = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
            async with running_router(router_config(backends, kvtier_servers=nodes)) as router:
                url = f"http://127.0.0.1:{router.port}"
                found = await asyncio.to_thread(discover, url)
                assert found is not None
                assert found.backends == tuple(b.url for b in backends)
                assert found.kvtier_servers == tuple(nodes)
                await backends[1].stop()
                await wait_for(lambda: not router.pool.backends[1].healthy)
                async with aiohttp.ClientSession() as s, s.get(f"{url}/kvtier/backends") as r:
                    rows = (await r.json())["backends"]
                assert [row["up"] for row in rows] == [True, False]
                assert rows[1]["reason"].startswith("/health")
                assert await asyncio.to_thread(discover, backends[0].url) is None, \
                    "an instance is not a router: nothing to discover"
    asyncio.run(main())


def test_credentials_in_backend_urls_are_never_listed() -> None:
    async def main() -> None:
        async with stubs(1) as backends:
            secret = backends[0].url.replace("http://", "http://user:s3cret@")
            config = router_config(backends)
            config = type(config)(**{**config.__dict__, "backends": (secret,)})
            async with running_router(config) as router, aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                async with s.get(f"{url}/kvtier/backends") as r:
                    text = await r.text()
                assert "s3cret" not in text and "***@" in text
                assert await asyncio.to_thread(discover, url) is None
    asyncio.run(main())


def test_the_stack_parts_states_are_in_the_router_metrics(tmp_path: Path) -> None:
    state = tmp_path / "stack.json"

    def write(parts: dict[str, object]) -> None:
        state.write_text(json.dumps({"parts": parts}))

    async def sample(s: aiohttp.ClientSession, url: str) -> str:
        async with s.get(f"{url}/metrics") as r:
            return await r.text()

    async def main() -> None:
        async with stubs(1) as backends, running_router(
                router_config(backends, parts_file=str(state))) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}"
            assert "kvtier_stack_part_up{" not in await sample(s, url), "no file: nothing"
            write({"instance 0": {"state": "up", "restarts": 0},
                   "instance 1": {"state": "restarting", "restarts": 2}})
            text = await sample(s, url)
            assert 'kvtier_stack_part_up{part="instance 0"} 1.0' in text
            assert 'kvtier_stack_part_up{part="instance 1"} 0.0' in text
            assert 'kvtier_stack_part_state{part="instance 1",state="restarting"} 1.0' in text
            assert 'kvtier_stack_part_state{part="instance 1",state="up"} 0.0' in text
            assert 'kvtier_stack_part_restarts_total{part="instance 1"} 2.0' in text
            write({"instance 1": {"state": "given up", "restarts": 5}})
            text = await sample(s, url)
            assert 'kvtier_stack_part_state{part="instance 1",state="given up"} 1.0' in text
            assert 'part="instance 0"' not in text
            state.write_text("{not json")
            assert "kvtier_stack_part_up{" not in await sample(s, url)
    asyncio.run(main())


@pytest.mark.parametrize("message", [
    "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    "cannot schedule new futures after shutdown"])
def test_an_answer_from_a_dead_engine_is_served_by_another_backend(message: str) -> None:
    """vLLM's API server answers 500 'EngineCore encountered an issue' between its
    EngineCore's death and its own exit, and 'cannot schedule new futures' while it shuts
    down: that request was never served, so another backend serves it; an ordinary 500 is
    passed through, as vLLM sent it."""
    from aiohttp import web

    async def main() -> None:
        async with stubs(2) as backends, running_router(
                router_config(backends, health_interval_s=60)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}/v1/completions"

            async def dead(request: web.Request) -> web.Response:
                await request.read()
                return web.json_response({"error": {
                    "message": message, "type": "InternalServerError", "code": 500}},
                    status=500)

            backends[0]._complete = dead
            await backends[0].stop()
            await backends[0].start()  # same port, the dead engine's answer
            status, doc, headers = await post(s, url, completion())
            assert status == 200 and headers["X-Kvtier-Backend"] == backends[1].url, doc
            assert [b.healthy for b in router.pool] == [False, True]
            backends[1].status = 500
            status, doc, _ = await post(s, url, completion())
            assert status == 500 and "stub says 500" in doc["error"]["message"]
    asyncio.run(main())


def test_the_backend_list_needs_the_api_key_when_there_is_one() -> None:
    async def main() -> None:
        async with stubs(1) as backends:
            config = router_config(backends, api_key="the router's key 0123456789")
            async with running_router(config) as router, aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                async with s.get(f"{url}/kvtier/backends") as r:
                    assert r.status == 401, "internal addresses are not for anyone"
                found = await asyncio.to_thread(
                    discover, url, {"Authorization": "Bearer the router's key 0123456789"})
                assert found is not None and found.backends == (backends[0].url,)
    asyncio.run(main())
