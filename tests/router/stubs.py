"""OpenAI-shaped stub backends (real aiohttp servers on 127.0.0.1) and a router to test.

A :class:`StubBackend` answers ``/health``, ``/v1/models``, ``/metrics`` and both completion
endpoints, whole or streamed (SSE, one chunk per token, ``token_s`` apart plus
``token_s_per_stream`` for each other stream it is sending then, the first after ``ttft_s``),
records what it was sent, and can be told to fail. With an
:class:`EngineModel` it behaves like a kvtier engine for the cache strategy's tests: prompts
are token ids cut into chunks, one prefill at a time, the chunks a real node server holds
cost their arrival time, the rest ``tokens / speed``; the prompt's chunks are then stored on
that node server, and the answer's ``kv_transfer_params.kvtier.tokens`` says where they came
from.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from store_helpers import NS, SLOT_BYTES, client_store

from kvtier.client import KvtierClient
from kvtier.config import ServerConfig
from kvtier.keys import chunk_keys
from kvtier.protocol import Register
from kvtier.router.app import Router
from kvtier.router.config import CostModel, RouterConfig
from kvtier.server import EmbeddedServer, NodeServer

MODEL = "stub-model"


def node(root: Path, shared: Path | None = None, slots: int = 256) -> NodeServer:
    """A real node server on ``root`` (HTTP API on a free port, an arena of ``slots``) with,
    if ``shared`` is given, an ``fs`` tier named ``shared`` in that folder."""
    tiers = [] if shared is None else [{
        "type": "fs", "name": "shared", "capacity_bytes": 64 << 20, "io_threads": 2,
        "options": {"path": str(shared), "journal_interval_s": 0.05, "poll_s": 0.1,
                    "sweep_interval_s": 600}}]
    config = ServerConfig.from_dict({
        "socket_path": str(root / "kvtier.sock"), "metrics_port": 0, "tiers": tiers,
        "arena": {"size_bytes": slots * SLOT_BYTES, "slot_bytes": SLOT_BYTES,
                  "free_target": 0.0}})
    return EmbeddedServer(config).start()


def held_by(server: NodeServer, tokens: list[int], chunk: int = 16) -> list[str]:
    with KvtierClient(server.socket_path) as client:
        return list(client.lookup(chunk_keys(NS, tokens, chunk)))


def with_engines(backends: list[StubBackend], nodes: list[NodeServer], speed: float,
                 chunk_tokens: int = 16) -> list[str]:
    """Gives each stub backend an :class:`EngineModel` on its node server (registered
    there, as the connector registers); returns the node servers' HTTP URLs, in order."""
    for backend, server in zip(backends, nodes, strict=True):
        backend.engine = EngineModel(server, chunk_tokens=chunk_tokens, speed=speed)
        backend.engine.register()
    return [f"http://127.0.0.1:{n.metrics_port}" for n in nodes]


@dataclass
class EngineModel:
    """A kvtier engine's prefill, for the cache strategy: chunks held on ``node`` cost their
    arrival, the rest ``speed`` tokens per second, one request at a time."""

    node: NodeServer
    chunk_tokens: int = 16
    speed: float = 2000.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def register(self, tokenizer: str = "/nonexistent/tokenizer") -> None:
        with KvtierClient(self.node.socket_path) as client:
            # what the vLLM connector registers, its short namespace included
            client.call(Register(NS, {"model": "m", "chunk_tokens": self.chunk_tokens,
                                      "served_model_name": MODEL, "tokenizer": tokenizer,
                                      "namespace": NS.hex()[:16]}))

    async def prefill(self, tokens: list[int], cache_salt: str | None = None) -> dict[str, int]:
        # the connector's extras: the request's cache_salt roots the chain
        extras = (f"salt:{cache_salt}",) if cache_salt else ()
        keys = chunk_keys(NS, tokens, self.chunk_tokens, extras)
        async with self.lock:
            hit = await asyncio.to_thread(self._lookup, keys)
            held = {t: 0 for t in hit}
            for tier in hit:
                held[tier] += self.chunk_tokens
            recomputed = len(tokens) - len(hit) * self.chunk_tokens
            await asyncio.sleep(recomputed / self.speed + 0.002 * len(hit))
            # what it loaded from a lower tier is in its arena now, as the connector's lease
            # promotes it; what it computed is stored there
            loaded = [k for k, tier in zip(keys, hit, strict=False) if tier != "arena"]
            await asyncio.to_thread(self._store, loaded + keys[len(hit):])
        return {"device": 0, **held, "recomputed": recomputed}

    def _lookup(self, keys: list[Any]) -> list[str]:
        with KvtierClient(self.node.socket_path) as client:
            return list(client.lookup(keys))

    def _store(self, keys: list[Any]) -> None:
        if keys:
            with KvtierClient(self.node.socket_path) as client:
                client_store(client, keys)


@dataclass
class StubBackend:
    ttft_s: float = 0.0
    token_s: float = 0.0
    token_s_per_stream: float = 0.0
    """Streams: each other stream in progress makes a step this much longer."""
    tokens: int = 4
    api_key: str | None = None
    engine: EngineModel | None = None
    status: int = 200
    """Answer completions with this status (and an OpenAI error body) instead."""
    hang_first_byte: bool = False
    """Streams: send headers, then never a byte (until stopped)."""
    stream_details: bool = False
    """Streams: the last event carries ``kv_transfer_params.kvtier``, written in two pieces
    split inside its line."""
    cached_tokens: int | None = None
    """Answers carry ``usage.prompt_tokens_details.cached_tokens`` of this many (whole, and
    in streams asking for usage)."""
    answer_headers: dict[str, str] = field(default_factory=dict)
    """Sent on every completion's answer (whole and streamed)."""
    finish_reason: str | None = None
    """How answers end (whole: ``length`` when unset; streams: their last token's event
    says it only when set)."""
    seen: list[dict[str, Any]] = field(default_factory=list)
    health_headers: list[dict[str, str]] = field(default_factory=list)
    running: int = 0
    streaming: int = 0
    url: str = ""
    host: str = "127.0.0.1"
    """The loopback address it listens on (127.0.0.x in a network namespace of a test's own)."""
    _runner: web.AppRunner | None = None
    _port: int = 0
    _open: set[Any] = field(default_factory=set)

    async def start(self) -> StubBackend:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port, reuse_address=True)
        await site.start()
        self._port = int(self._runner.addresses[0][1])
        self.url = f"http://{self.host}:{self._port}"
        return self

    async def kill(self) -> None:
        """Die at once: every open connection is reset (streams are cut), nothing listens."""
        for transport in list(self._open):
            transport.abort()
        await self.stop()

    async def stop(self) -> None:
        """Close the listener and the connections (answers in progress get 0.1 s)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _authorized(self, request: web.Request) -> bool:
        return self.api_key is None or \
            request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def _health(self, request: web.Request) -> web.Response:
        self.health_headers.append(dict(request.headers))
        return web.Response(status=200 if self._authorized(request) else 401)

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": self.url}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (f"vllm:num_requests_running{{engine=\"0\"}} {self.running}\n"
                "vllm:num_requests_waiting{engine=\"0\"} 0\n")
        return web.Response(text=text)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.seen.append({"path": request.path, "body": body,
                          "headers": dict(request.headers), "at": time.monotonic()})
        if not self._authorized(request):
            return web.json_response({"error": {"message": "unauthorized"}}, status=401)
        if self.status != 200:
            return web.json_response({"error": {"message": f"stub says {self.status}",
                                                "code": self.status}}, status=self.status)
        self.running += 1
        self._open.add(request.transport)
        try:
            sources = await self._prefill(body)
            if body.get("stream"):
                return await self._stream(request, body)
            await asyncio.sleep(self.token_s * max(0, self.tokens - 1))
            return web.json_response(headers=self.answer_headers, data={
                "id": "cmpl-stub", "object": "text_completion", "model": MODEL,
                "choices": [{"index": 0, "text": " w" * self.tokens,
                             "finish_reason": self.finish_reason or "length"}],
                "usage": self._usage(body, self.tokens),
                "kv_transfer_params": {"kvtier": {"tokens": sources}} if sources else None,
                "served_by": self.url})
        finally:
            self.running -= 1
            self._open.discard(request.transport)

    def _usage(self, body: dict[str, Any], generated: int) -> dict[str, Any]:
        """``usage`` as vLLM with ``--enable-prompt-tokens-details`` (as ``kvtier serve``
        starts it) writes it: ``cached_tokens`` counts the prompt tokens a cache served."""
        prompt = len(body.get("prompt") or body.get("messages") or "")
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": generated,
                                 "total_tokens": prompt + generated}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    async def _prefill(self, body: dict[str, Any]) -> dict[str, int] | None:
        prompt = body.get("prompt")
        if self.engine is not None and isinstance(prompt, list):
            return await self.engine.prefill(prompt, body.get("cache_salt"))
        await asyncio.sleep(self.ttft_s)
        return None

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           **self.answer_headers})
        await resp.prepare(request)
        options = body.get("stream_options") or {}
        if self.hang_first_byte:
            await asyncio.sleep(3600)
        self.streaming += 1
        try:
            for i in range(self.tokens):
                if i:
                    await asyncio.sleep(self.token_s
                                        + self.token_s_per_stream * (self.streaming - 1))
                chunk = {"id": "cmpl-stub", "choices": [{"index": 0, "text": f" w{i}"}],
                         "served_by": self.url}
                if self.finish_reason is not None and i == self.tokens - 1:
                    chunk["choices"][0]["finish_reason"] = self.finish_reason
                if options.get("continuous_usage_stats"):
                    chunk["usage"] = self._usage(body, i + 1)
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        finally:
            self.streaming -= 1
        if self.stream_details:
            last = {"id": "cmpl-stub", "choices": [], "kv_transfer_params": {
                "kvtier": {"tokens": {"arena": 16, "recomputed": 4}}, "other": 1}}
            event = f"data: {json.dumps(last)}\n\n".encode()
            await resp.write(event[:20])
            await asyncio.sleep(0.05)
            await resp.write(event[20:])
        if options.get("include_usage"):
            last = {"id": "cmpl-stub", "choices": [], "usage": self._usage(body, self.tokens)}
            await resp.write(f"data: {json.dumps(last)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def router_config(backends: list[StubBackend], **kw: Any) -> RouterConfig:
    servers = kw.pop("kvtier_servers", None)
    cost = kw.pop("cost", CostModel())
    return RouterConfig(backends=tuple(b.url for b in backends),
                        kvtier_servers=tuple(servers or [None] * len(backends)),
                        port=0, health_interval_s=kw.pop("health_interval_s", 0.2),
                        cost=cost, **kw)


@asynccontextmanager
async def running_router(config: RouterConfig) -> AsyncIterator[Router]:
    router = Router(config)
    await router.start()
    try:
        yield router
    finally:
        await router.close()


@asynccontextmanager
async def stubs(n: int, **kw: Any) -> AsyncIterator[list[StubBackend]]:
    made = [await StubBackend(**kw).start() for _ in range(n)]
    try:
        yield made
    finally:
        for stub in made:
            await stub.stop()


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    async with session.post(url, json=body, headers=headers or {}) as resp:
        text = await resp.text()
        try:
            doc: Any = json.loads(text)
        except ValueError:
            doc = text
        return resp.status, doc, dict(resp.headers)


def completion(prompt: Any = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}
