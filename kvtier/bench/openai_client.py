"""One request to an OpenAI-compatible endpoint, timed token by token.

Streaming (SSE, the default) gives time to first token and the gaps between content chunks
(inter-token latencies); ``stream_options.include_usage`` asks for the final usage chunk.
Where the prompt's KV came from is read, in this order, from:

1. ``kv_transfer_params.kvtier.tokens`` (kvtier's connector: device / arena / disk / ... /
   recomputed) on any chunk or the whole response. vLLM 0.32's OpenAI server puts
   ``kv_transfer_params`` on non-streamed responses only (its ``CompletionStreamResponse``
   and ``ChatCompletionStreamResponse`` have no such field), so per-tier figures per request
   need ``stream=False``; a server that sends it on a chunk is read the same way.
2. ``usage.prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-
   details``, OpenAI): prefix-cached tokens, device and connector together.

A router that names the instance it chose (``kvtier route``'s ``X-Kvtier-Backend``) has it
recorded in ``RequestResult.backend``: a fleet run's slow requests can then be placed. Its
estimate for that instance (``X-Kvtier-Estimate``, the ``cache`` strategy's) is kept in
``RequestResult.estimate``: each request's predicted first token beside its actual one.

Errors never raise out of :meth:`Endpoint.send`: they come back in ``RequestResult.error``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Api = Literal["chat", "completions"]
KV_KVTIER = "kvtier"
KV_CACHED = "cached_tokens"
BACKEND_HEADER = "X-Kvtier-Backend"
"""``kvtier route``'s header naming the instance (:data:`kvtier.router.proxy.BACKEND_HEADER`)."""
ESTIMATE_HEADER = "X-Kvtier-Estimate"
"""``kvtier route``'s estimate for it (:func:`kvtier.router.cost.estimate_header`)."""
MAX_ESTIMATE_FIELDS = 16
"""The most fields of an estimate kept (a header is whatever the endpoint sends)."""
MAX_ESTIMATE_VALUE = 64
"""The longest value of one field, in characters."""


@dataclass(frozen=True)
class RequestSpec:
    user: int
    round: int
    warmup: bool
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Sent as the body's ``kv_transfer_params`` (kvtier's per-request options: retention,
    release, ...); None: no such field."""


@dataclass
class RequestResult:
    user: int
    round: int
    warmup: bool
    start_s: float
    """Sent at this time, in seconds from the start of the run."""
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    kv_tokens: dict[str, int] | None = None
    """Prompt tokens by where their KV came from (sums to prompt_tokens)."""
    kv_source: str | None = None
    """``kvtier``, ``cached_tokens`` or None (the endpoint said nothing)."""
    backend: str | None = None
    """The instance that served it, where a router names it (``kvtier route``'s
    ``X-Kvtier-Backend`` header), else None."""
    estimate: dict[str, float | str] | None = None
    """The router's estimate for that instance (``X-Kvtier-Estimate``: ``ttft``, its parts,
    ``crowd``, ``held``, ``reason``, ...), else None."""
    error: str | None = None
    text: str = ""

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class EndpointConfig:
    url: str
    model: str
    api: Api = "chat"
    stream: bool = True
    ignore_eos: bool = True
    api_key: str | None = None
    timeout_s: float = 600.0
    user_header: str | None = None
    """Send the user's number in this header (session-affinity routers)."""


class Endpoint:
    def __init__(self, config: EndpointConfig, t0: float | None = None) -> None:
        self.config = config
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t0_unix = time.time() - (time.perf_counter() - self.t0)
        """The Unix time of ``t0``: a request's ``start_s`` plus this is when it was sent,
        on the clock of other processes' logs and samples."""
        headers = {"Content-Type": "application/json"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(base_url=config.url.rstrip("/"), headers=headers,
                                       timeout=httpx.Timeout(config.timeout_s), limits=limits)

    async def close(self) -> None:
        await self._http.aclose()

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.config.model, "max_tokens": spec.max_tokens,
                                "temperature": 0.0, "stream": self.config.stream}
        if self.config.api == "chat":
            body["messages"] = spec.messages
        else:
            body["prompt"] = spec.prompt
        if self.config.stream:
            body["stream_options"] = {"include_usage": True}
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension: every answer has max_tokens
        if spec.kv_transfer_params is not None:
            body["kv_transfer_params"] = spec.kv_transfer_params
        return body

    async def send(self, spec: RequestSpec, first_token: asyncio.Event | None = None
                   ) -> RequestResult:
        """One request; ``first_token`` is set when its first token arrives (streamed), or
        when it ends (whole, or failed)."""
        path = "/v1/chat/completions" if self.config.api == "chat" else "/v1/completions"
        headers = {}
        if self.config.user_header:
            headers[self.config.user_header] = str(spec.user)
        result = RequestResult(spec.user, spec.round, spec.warmup, self.now())
        try:
            if self.config.stream:
                await self._stream(path, spec, headers, result, first_token)
            else:
                await self._whole(path, spec, headers, result)
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
        except (ValueError, KeyError, TypeError) as exc:
            result.error = f"bad response: {exc}"[:300]
        finally:
            if first_token is not None:
                first_token.set()
        result.end_s = self.now()
        return result

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def _stream(self, path: str, spec: RequestSpec, headers: dict[str, str],
                      result: RequestResult, first_token: asyncio.Event | None) -> None:
        last: float | None = None
        chunks = 0
        parts: list[str] = []
        async with self._http.stream("POST", path, json=self.body(spec),
                                     headers=headers) as resp:
            result.backend = resp.headers.get(BACKEND_HEADER)
            result.estimate = parse_estimate(resp.headers.get(ESTIMATE_HEADER))
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {_error_text(event['error'])}"
                    return
                piece = _piece(event, self.config.api)
                if piece:
                    now = self.now()
                    if last is None:
                        result.ttft_s = now - result.start_s
                        if first_token is not None:
                            first_token.set()
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    parts.append(piece)
                _read_accounting(event, result)
        result.text = "".join(parts)
        if result.output_tokens is None:
            result.output_tokens = chunks

    async def _whole(self, path: str, spec: RequestSpec, headers: dict[str, str],
                     result: RequestResult) -> None:
        resp = await self._http.post(path, json=self.body(spec), headers=headers)
        result.backend = resp.headers.get(BACKEND_HEADER)
        result.estimate = parse_estimate(resp.headers.get(ESTIMATE_HEADER))
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            return
        event = resp.json()
        if "error" in event:
            result.error = f"error: {_error_text(event['error'])}"
            return
        result.text = _piece(event, self.config.api, whole=True)
        _read_accounting(event, result)


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:200]
    return str(error)[:200]


def _piece(event: dict[str, Any], api: Api, whole: bool = False) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if api == "completions":
        return str(choice.get("text") or "")
    message = choice.get("message" if whole else "delta") or {}
    return str(message.get("content") or "")


def _read_accounting(event: dict[str, Any], result: RequestResult) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict):
        if usage.get("prompt_tokens") is not None:
            result.prompt_tokens = int(usage["prompt_tokens"])
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is not None and result.kv_source != KV_KVTIER and result.prompt_tokens:
            n = int(cached)
            result.kv_tokens = {"cached": n, "recomputed": max(0, result.prompt_tokens - n)}
            result.kv_source = KV_CACHED
    params = event.get("kv_transfer_params")
    kvtier = params.get("kvtier") if isinstance(params, dict) else None
    tokens = kvtier.get("tokens") if isinstance(kvtier, dict) else None
    if isinstance(kvtier, dict) and isinstance(tokens, dict):
        result.kv_tokens = {str(k): int(v) for k, v in tokens.items()}
        result.kv_source = KV_KVTIER
        if result.prompt_tokens is None and kvtier.get("prompt_tokens") is not None:
            result.prompt_tokens = int(kvtier["prompt_tokens"])


def parse_estimate(value: str | None) -> dict[str, float | str] | None:
    """``ttft=0.1612; wait=0; ...; reason=affinity`` as a dict: numbers as floats, the rest
    as text (at most :data:`MAX_ESTIMATE_VALUE` characters). None when absent or not of that
    form (a part without ``=``, a name that is not a word); at most
    :data:`MAX_ESTIMATE_FIELDS` fields are read."""
    if not value:
        return None
    out: dict[str, float | str] = {}
    parts = [p for p in value.split(";") if p.strip()]
    for part in parts[:MAX_ESTIMATE_FIELDS]:
        name, sep, text = part.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name.isidentifier() or len(text) > MAX_ESTIMATE_VALUE:
            return None
        try:
            number = float(text)
        except ValueError:
            out[name] = text
            continue
        out[name] = number if math.isfinite(number) else text
    return out or None
