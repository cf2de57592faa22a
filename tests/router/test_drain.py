"""Graceful drain: on SIGTERM ``kvtier route`` stops accepting and finishes what is in
flight, up to ``--drain-s``."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from stubs import StubBackend, completion, router_config, running_router

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_healthy(s: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]
                       ) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            async with s.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("kvtier route never became healthy")


async def refuses_connections(url: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            async with aiohttp.ClientSession() as fresh, fresh.get(f"{url}/health"):
                pass
        except aiohttp.ClientConnectionError:
            return True
        await asyncio.sleep(0.05)
    return False


def test_sigterm_stops_accepting_and_finishes_the_streams_in_flight() -> None:
    async def main() -> None:
        backend = await StubBackend(tokens=10, token_s=0.1).start()
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "route", "--backends", backend.url,
             "--port", str(port), "--drain-s", "10", "--health-interval-s", "0.5"],
            env=env, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                await wait_healthy(s, url, proc)
                async with s.post(f"{url}/v1/completions",
                                  json=completion(stream=True)) as resp:
                    first = await resp.content.readany()
                    assert first.startswith(b"data:")
                    proc.send_signal(signal.SIGTERM)
                    assert await refuses_connections(url, within_s=0.8)
                    rest = await resp.read()
                assert rest.rstrip().endswith(b"data: [DONE]"), "the stream was finished"
                assert proc.wait(timeout=15) == 0
                log = proc.stderr.read().decode() if proc.stderr else ""
                assert "draining: 1 requests in flight" in log
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            await backend.stop()
    asyncio.run(main())


def test_drain_gives_up_after_drain_s() -> None:
    async def main() -> None:
        backend = await StubBackend(tokens=50, token_s=0.1).start()
        try:
            async with running_router(router_config([backend], drain_s=0.3)) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                async with s.post(url, json=completion(stream=True)) as resp:
                    await resp.content.readany()
                    started = time.monotonic()
                    assert await router.drain() is False
                    assert 0.25 < time.monotonic() - started < 2.0
                    assert router.active == 1
        finally:
            await backend.stop()
    asyncio.run(main())
