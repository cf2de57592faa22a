"""One attempt at one backend: send the client's bytes, pass the answer back.

- A streamed answer (``text/event-stream``) goes back chunk by chunk as the backend sends it
  (``readany``: whatever bytes arrived, never waiting for more). The client's response
  starts only with the backend's first body byte, so a backend that dies before it (while
  prefilling) can still be replaced: that attempt raises :class:`BackendFailed`.
- Any other answer is read whole and passed back with its status, headers and body — errors
  included (a 400 or 500 from vLLM reaches the client as vLLM sent it) — except one that says
  the backend did not serve it and cannot (a 503, or vLLM's 500 once its EngineCore died):
  that attempt raises :class:`BackendFailed` too, so another backend serves the request.
- A backend failing mid-stream cannot be hidden: the client gets an SSE error event and the
  connection is closed without the stream's end, so it knows the answer is cut.
- For a tenant not allowed to see them, ``kv_transfer_params.kvtier`` and ``usage.
  prompt_tokens_details.cached_tokens`` are taken out of the answer, whole or streamed
  (:mod:`kvtier.router.details`); the router's own accounting reads the answer before that.
- Timeouts are not failures of the backend: aiohttp's ``ServerTimeoutError`` (a
  ``ClientConnectionError`` too) is caught before the connection errors. A timeout while
  connecting may be retried elsewhere; a timeout after the request was sent (no answer, or
  no next byte, within ``sock_read``) is not — the backend may still be generating it — and
  neither takes the backend out.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvtier.router.details import StreamStripper, strip_body
from kvtier.router.finish import FinishWatch, of_doc

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length"})
_NOT_BACK = HOP_BY_HOP | {"date", "server"}
BACKEND_HEADER = "X-Kvtier-Backend"
ESTIMATE_HEADER = "X-Kvtier-Estimate"
"""The ``cache`` strategy's estimate for the backend it chose
(:func:`kvtier.router.cost.estimate_header`)."""
_NOT_OURS = _NOT_BACK | {BACKEND_HEADER.lower(), ESTIMATE_HEADER.lower()}
"""Also the router's own headers: a backend's are dropped (it cannot speak for the router)."""
ENGINE_DEAD = (b"EngineDeadError", b"EngineCore encountered an issue",
               b"cannot schedule new futures after shutdown")
"""How vLLM 0.32 words an answer from an API server whose EngineCore is gone, or that is
shutting down (its executors refuse new work: the request was not started)."""


class BackendFailed(Exception):
    """The attempt failed before any byte reached the client."""

    def __init__(self, message: str, *, down: bool, retry: bool = True) -> None:
        super().__init__(message)
        self.down = down
        """True when the backend itself looks gone (refused, reset): take it out."""
        self.retry = retry
        """False when the backend may still be working on the request (it timed out after
        the request was sent): sending it elsewhere would generate it twice."""


def _timed_out(exc: BaseException, when: str) -> BackendFailed:
    """A timeout after the request was sent: not retried, the backend stays in."""
    return BackendFailed(f"timed out {when}: {type(exc).__name__}", down=False, retry=False)


@dataclass
class Outcome:
    status: int
    streamed: bool
    first_byte: float | None = None
    last_byte: float | None = None
    chunks: int = 0
    doc: dict[str, Any] | None = None
    """The whole answer's JSON (status 200), or the streamed event that carried
    ``kv_transfer_params`` (none in vLLM 0.32)."""
    extra: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    """How the answer ended (its choices' ``finish_reason``), if it said."""


def outgoing_headers(client: Mapping[str, str], authorization: str | None,
                     keep_client_auth: bool) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in client.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or (lower == "authorization" and not keep_client_auth):
            continue
        out.add(name, value)
    if authorization is not None:
        out["Authorization"] = authorization
    return out


def _back_headers(backend: Mapping[str, str], ours: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict(
        (k, v) for k, v in backend.items() if k.lower() not in _NOT_OURS)
    out.update(ours)
    return out


async def forward(session: aiohttp.ClientSession, url: str, ours: Mapping[str, str], raw: bytes,
                  headers: CIMultiDict[str], client: web.Request, timeout: aiohttp.ClientTimeout,
                  on_first_byte: Callable[[float], None], *, strip_details: bool = False
                  ) -> tuple[web.StreamResponse, Outcome]:
    """``raw`` to the backend at ``url``, its answer to ``client`` (streamed as it comes),
    with the router's own headers ``ours`` on it in place of any the backend sent."""
    try:
        resp = await session.post(url, data=raw, headers=headers, timeout=timeout,
                                  skip_auto_headers=("Accept-Encoding", "Content-Type"))
    except aiohttp.ConnectionTimeoutError as exc:  # nothing was sent: another may serve it
        raise BackendFailed(f"timed out connecting: {exc}", down=False) from exc
    except TimeoutError as exc:  # ServerTimeoutError (sock_read) or asyncio's: sent, silent
        raise _timed_out(exc, "before answering") from exc
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise BackendFailed(f"{type(exc).__name__}: {exc}", down=True) from exc
    async with resp:
        if resp.content_type == "text/event-stream":
            return await _stream(resp, ours, client, on_first_byte,
                                 StreamStripper() if strip_details else None)
        return await _whole(resp, ours, on_first_byte, strip_details)


async def _whole(resp: aiohttp.ClientResponse, ours: Mapping[str, str],
                 on_first_byte: Callable[[float], None], strip_details: bool
                 ) -> tuple[web.StreamResponse, Outcome]:
    try:
        body = await resp.read()
    except TimeoutError as exc:
        raise _timed_out(exc, "while answering") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendFailed(f"answer cut: {type(exc).__name__}: {exc}", down=True) from exc
    if _unavailable(resp.status, body):
        raise BackendFailed(f"answered {resp.status} without serving it: "
                            f"{body[:120].decode(errors='replace')}", down=True)
    now = time.monotonic()
    on_first_byte(now)
    outcome = Outcome(resp.status, False, now, now, 1)
    if resp.status == 200 and resp.content_type == "application/json":
        try:
            doc = json.loads(body)
            outcome.doc = doc if isinstance(doc, dict) else None
        except (ValueError, RecursionError):
            pass
        outcome.finish_reason = of_doc(outcome.doc)
    if strip_details:
        body = strip_body(body)
    out = web.Response(status=resp.status, reason=resp.reason, body=body,
                       headers=_back_headers(resp.headers, ours))
    return out, outcome


async def _stream(resp: aiohttp.ClientResponse, ours: Mapping[str, str], client: web.Request,
                  on_first_byte: Callable[[float], None], stripper: StreamStripper | None
                  ) -> tuple[web.StreamResponse, Outcome]:
    try:
        first = await resp.content.readany()
    except TimeoutError as exc:
        raise _timed_out(exc, "before its first byte") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise BackendFailed(f"stream cut before its first byte: {exc}", down=True) from exc
    if not first:
        raise BackendFailed("stream ended before its first byte", down=True)
    outcome = Outcome(resp.status, True, time.monotonic())
    on_first_byte(outcome.first_byte or 0.0)
    out = web.StreamResponse(status=resp.status, reason=resp.reason,
                             headers=_back_headers(resp.headers, ours))
    await out.prepare(client)
    chunk = first
    finish = FinishWatch()
    while chunk:
        finish.feed(chunk)
        outcome.finish_reason = finish.reason
        if b'"kv_transfer_params"' in chunk:
            outcome.doc = _event_with_params(chunk) or outcome.doc
        data = stripper.feed(chunk) if stripper else chunk
        try:
            if data:
                await out.write(data)
        except (ConnectionError, RuntimeError):  # the client went away: stop reading
            outcome.extra["client_gone"] = True
            return out, outcome
        outcome.chunks += 1
        outcome.last_byte = time.monotonic()
        try:
            chunk = await resp.content.readany()
        except TimeoutError as exc:  # slow, not gone: the backend stays in
            outcome.extra["timed_out"] = type(exc).__name__
            await _cut(out, client, "the backend sent nothing for the request timeout", 504)
            return out, outcome
        except (aiohttp.ClientError, OSError) as exc:
            outcome.extra["cut"] = f"{type(exc).__name__}: {exc}"
            await _cut(out, client)
            return out, outcome
    with contextlib.suppress(ConnectionError, RuntimeError):
        rest = stripper.flush() if stripper is not None else b""
        if rest:
            await out.write(rest)
        await out.write_eof()
    return out, outcome


async def _cut(out: web.StreamResponse, client: web.Request,
               message: str = "the backend failed mid-stream", code: int = 502) -> None:
    event = {"error": {"message": message, "type": "BackendError", "code": code}}
    with contextlib.suppress(ConnectionError, RuntimeError):
        await out.write(f"data: {json.dumps(event)}\n\n".encode())
    if client.transport is not None:
        client.transport.close()  # no final chunk: the client sees a cut stream


def _unavailable(status: int, body: bytes) -> bool:
    """The backend did not serve the request and cannot: a 503, or vLLM's answer once its
    EngineCore died (a 500 naming it; the API server exits soon after). Another backend
    may serve it; this one is taken out until its health check passes again."""
    return status == 503 or (status == 500 and any(m in body for m in ENGINE_DEAD))


def _event_with_params(chunk: bytes) -> dict[str, Any] | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data:") and b'"kv_transfer_params"' in line:
            try:
                doc = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(doc, dict):
                return doc
    return None


def error_response(status: int, message: str, kind: str = "RouterError") -> web.Response:
    doc = {"error": {"message": message, "type": kind, "code": status}}
    return web.json_response(doc, status=status)
