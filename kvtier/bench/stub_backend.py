"""A minimal OpenAI-shaped backend for measuring the router itself (``kvtier bench route``).

``python -m kvtier.bench.stub_backend --port P [--chunks N]``: ``/health``, ``/v1/models``,
``/metrics`` and both completion endpoints, answered at once (a whole JSON answer, or ``N``
SSE chunks and ``[DONE]``), so what a client measures through a router is the router's
own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

MODEL = "stub"
ANSWER = json.dumps({"id": "cmpl-stub", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 8, "completion_tokens": 1,
                               "total_tokens": 9}}).encode()


def make_app(chunks: int) -> web.Application:
    event = b'data: {"id":"cmpl-stub","choices":[{"index":0,"text":" w"}]}\n\n'

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(chunks):
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(port: int, chunks: int) -> None:
    """Serve on 127.0.0.1:``port`` until SIGTERM or SIGINT."""
    runner = web.AppRunner(make_app(chunks), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=fast_loop()) as runner:
        runner.run(serve(args.port, args.chunks))
    return 0


def fast_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    sys.exit(main())
