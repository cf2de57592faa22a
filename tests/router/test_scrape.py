"""A backend's /metrics, read by the router: broken or hostile pages cost nothing but their
own numbers; the router stays up and keeps the backend in."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from stubs import StubBackend, router_config, running_router

from kvtier.prom import MAX_CHARS, MAX_LINES, samples
from kvtier.router.scrape import engine_gauges

RUNNING = 'vllm:num_requests_running{engine="0"} 2\n'
WAITING = 'vllm:num_requests_waiting{engine="0"} 3\n'
CACHE = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0\n'


def test_a_broken_line_is_skipped_and_the_rest_still_counts() -> None:
    text = RUNNING + 'vllm:num_requests_running{engine="1} 7\n' + WAITING + CACHE \
        + 'vllm:num_requests_waiting{engine="1"} lots\n'
    gauges = engine_gauges(text)
    assert (gauges.running, gauges.waiting, gauges.device_tokens) == (2, 3, 16000)


@pytest.mark.parametrize("page", [
    "", "not prometheus at all", "\x00\xff{}}}\"\\" * 1000, "<html><body>502</body></html>",
    'vllm:num_requests_running{=""} 1\n', "vllm:num_requests_running\n",
    'vllm:cache_config_info{block_size="16"} 1\n',                  # no num_gpu_blocks
    'vllm:cache_config_info{block_size="x",num_gpu_blocks="1"} 1\n',  # not a number
    f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{"9" * 5000}"}} 1\n',
])
def test_pages_that_say_nothing_give_zeros(page: str) -> None:
    assert engine_gauges(page) == (0, 0, None)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_non_finite_gauge_counts_zero(value: str) -> None:
    gauges = engine_gauges(f'vllm:num_requests_running{{engine="0"}} {value}\n' + WAITING)
    assert (gauges.running, gauges.waiting) == (0, 3)


def test_a_huge_page_is_read_only_up_to_its_cap() -> None:
    head = RUNNING + "#" + "x" * (MAX_CHARS - 20 - len(RUNNING) - 2) + "\n"
    cut = head + 'vllm:num_requests_waiting{engine="0"} 12345678\n'  # crosses the cap
    assert len(head) < MAX_CHARS < len(cut)
    gauges = engine_gauges(cut + WAITING * 100)
    assert (gauges.running, gauges.waiting) == (2, 0)  # never 12 or 1234 from a cut number


def test_at_most_max_lines_are_read() -> None:
    started = time.monotonic()
    gauges = engine_gauges(RUNNING * (MAX_LINES * 20) + 'vllm:num_requests_running{ 1\n')
    assert gauges.running == 2 * MAX_LINES
    assert time.monotonic() - started < 10


def test_samples_keep_names_and_labels_and_drop_lookalikes() -> None:
    text = ('# TYPE vllm:x_total counter\nvllm:x_total{a="q\\"uote"} 1.5 1700000000\n'
            "vllm:x_total_other 9\nvllm:x_created 3\n")
    assert samples(text, ("vllm:x_total",)) == [("vllm:x_total", {"a": 'q"uote'}, 1.5)]


@dataclass
class HostileMetrics(StubBackend):
    page: str = ""

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.page)


@pytest.mark.parametrize("page", [
    "garbage {{{ \" \\ \n" * 10_000,
    RUNNING + 'vllm:num_requests_waiting{engine="0"} NaN\n' + CACHE,
])
def test_a_backend_with_a_hostile_metrics_page_stays_in(page: str) -> None:
    async def main() -> None:
        backend = await HostileMetrics(page=page).start()
        try:
            config = router_config([backend], health_interval_s=0.1)
            async with running_router(config) as router:
                await asyncio.sleep(0.35)  # a few more rounds
                state = router.pool.backends[0]
                assert state.healthy, state.reason
                expect = (2, 16000) if page.startswith(RUNNING) else (0, None)
                assert (state.load.others, state.device_tokens) == expect
                async with aiohttp.ClientSession() as s, \
                        s.get(f"http://127.0.0.1:{router.port}/metrics") as resp:
                    mine = await resp.text()
                assert f'kvtier_router_backend_others{{backend="{state.name}"}} ' \
                    f"{float(expect[0])}" in mine, "the router shows what it counted"
        finally:
            await backend.stop()
    asyncio.run(main())
