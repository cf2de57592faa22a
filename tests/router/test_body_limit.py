"""Request bodies are capped while they are read: a hostile client's 300 MB body (declared,
or chunked without a length) gets 413 and the router's memory does not grow with it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from stubs import StubBackend, completion, post, router_config, running_router, stubs
from test_drain import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


async def chunked(total: int, piece: int = MiB) -> AsyncIterator[bytes]:
    block = b"x" * piece
    for _ in range(total // piece):
        yield block


async def send_huge(url: str) -> int | None:
    """Streams 300 MB without a Content-Length; the status, or None if the router closed
    the connection before the client saw one."""
    try:
        async with aiohttp.ClientSession() as s, s.post(
                url, data=chunked(300 * MiB), timeout=aiohttp.ClientTimeout(total=60),
                headers={"Content-Type": "application/json"}) as resp:
            return resp.status
    except (aiohttp.ClientError, OSError):
        return None


def test_oversized_bodies_get_413_and_memory_stays_flat() -> None:
    async def main() -> None:
        backend = await StubBackend().start()
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "route", "--backends", backend.url,
             "--port", str(port), "--max-body-bytes", str(4 * MiB)],
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                await wait_healthy(s, url, proc)
                status, doc, _ = await post(s, f"{url}/v1/completions", completion())
                assert status == 200
                before = rss_kib(proc.pid)
                # a declared length over the cap: refused before a byte of the body is read
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 314572800\r\n\r\n{")
                await writer.drain()
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                assert head.startswith(b"HTTP/1.1 413"), head
                writer.close()
                started = time.monotonic()
                status = await send_huge(f"{url}/v1/completions")
                assert status in (413, None)
                assert time.monotonic() - started < 30
                status = await send_huge(f"{url}/v1/completions")
                peak = rss_kib(proc.pid, "VmHWM")
                grown = peak - before
                assert grown < 64 * 1024, f"router RSS grew {grown} KiB for a 300 MB body"
                async with s.post(f"{url}/v1/completions",
                                  data=b'{"prompt": "' + b"y" * (5 * MiB) + b'"}') as resp:
                    doc = await resp.json()
                    assert resp.status == 413 and "--max-body-bytes" in doc["error"]["message"]
                status, doc, _ = await post(s, f"{url}/v1/completions",
                                            completion("z" * (3 * MiB)))
                assert status == 200, "under the cap: served"
                assert len(backend.seen) == 2, "nothing oversized reached the backend"
                assert proc.poll() is None
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            await backend.stop()
    asyncio.run(main())


def test_the_cap_counts_chunked_bodies_in_process() -> None:
    async def main() -> None:
        async with stubs(1) as backends, running_router(router_config(
                backends, max_body_bytes=64 * 1024)) as router:
            url = f"http://127.0.0.1:{router.port}/v1/completions"
            async with aiohttp.ClientSession() as s, s.post(
                    url, data=chunked(10 * MiB, 16 * 1024)) as resp:
                assert resp.status == 413
            assert router.metrics.registry.get_sample_value(
                "kvtier_router_refused_total", {"reason": "too_large"}) == 1
            assert backends[0].seen == []
    asyncio.run(main())
