"""The chunk keys of a request's prompt, as the engine behind a backend computes them.

A node server lists the namespaces its engines registered (``GET /v1/namespaces``): the
fingerprint, ``chunk_tokens``, the tokenizer and the name clients call the model by. The
keys are ``kvtier.keys.chunk_keys(fingerprint, tokens, chunk_tokens, extras)`` with the
extras the connector adds (``salt:<cache_salt>``); the tokens come from
:mod:`kvtier.router.prompts`. Tokenizers load once, in a thread, the first time a namespace
names them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import ChunkKey, chunk_keys
from kvtier.router.prompts import PromptRenderer, brings_own_template, finish

log = logging.getLogger("kvtier.router")

INLINE_BODY_BYTES = 64 << 10
"""A body up to this size is rendered, cut and looked up on the event loop (~0.1 ms for a
17 KiB conversation on the development machine, more for a larger one: it grows with the
text); a larger one is rendered and encoded in a thread."""
INLINE_PARTS = 128
"""And has at most this many messages and content parts: building the conversation and
rendering the template cost per message (tiny messages fill 64 KiB with thousands)."""
INLINE_CHARS = 4096
"""Up to this much new text (~1.6 ms of tokenizer) is encoded on the event loop."""


@dataclass(frozen=True)
class NamespaceInfo:
    fingerprint: bytes
    chunk_tokens: int
    tokenizer: str
    served_model_name: str

    @classmethod
    def parse(cls, doc: Mapping[str, Any]) -> NamespaceInfo | None:
        """One entry of a node server's ``/v1/namespaces``; None if it lacks what keys need."""
        try:
            fp = bytes.fromhex(str(doc["namespace"]))
            chunk = int(doc["chunk_tokens"])
            tokenizer = str(doc.get("tokenizer") or doc["model"])
        except (KeyError, ValueError, TypeError):
            return None
        if len(fp) != 32 or chunk <= 0:
            return None
        name = str(doc.get("served_model_name") or doc.get("model") or "")
        return cls(fp, chunk, tokenizer, name)


def pick_namespace(spaces: Sequence[NamespaceInfo], model: str | None) -> NamespaceInfo | None:
    """The namespace serving ``model``: the last one registered under that name (an engine
    that reset its cache registers a new generation after the old one)."""
    if model is None:
        names = {ns.served_model_name for ns in spaces}
        return spaces[-1] if len(names) == 1 else None
    for ns in reversed(spaces):
        if ns.served_model_name == model:
            return ns
    return None


@dataclass(frozen=True)
class PromptKeys:
    namespace: NamespaceInfo
    prompt_tokens: int
    keys: tuple[ChunkKey, ...]

    @property
    def chunk_tokens(self) -> int:
        return self.namespace.chunk_tokens


def extras_of(body: Mapping[str, Any]) -> tuple[str, ...]:
    salt = body.get("cache_salt")
    return (f"salt:{salt}",) if salt else ()


class Renderers:
    """One :class:`PromptRenderer` per tokenizer, loaded on first use in a thread."""

    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Task[PromptRenderer | None]] = {}

    def prefetch(self, tokenizer: str) -> None:
        if tokenizer not in self._loading:
            self._loading[tokenizer] = asyncio.create_task(self._load(tokenizer))

    async def get(self, tokenizer: str) -> PromptRenderer | None:
        self.prefetch(tokenizer)
        return await asyncio.shield(self._loading[tokenizer])

    async def _load(self, tokenizer: str) -> PromptRenderer | None:
        try:
            renderer = await asyncio.to_thread(PromptRenderer, tokenizer)
        except Exception as exc:
            log.warning("cannot load tokenizer %s (%s: %s); its requests are routed without "
                        "keys", tokenizer, type(exc).__name__, exc)
            return None
        log.info("tokenizer %s loaded", tokenizer)
        return renderer


class RequestKeys:
    """A request's tokens per tokenizer and keys per namespace, each computed once."""

    def __init__(self, endpoint: str, body: Mapping[str, Any] | None,
                 renderers: Renderers, size: int | None = None) -> None:
        self.endpoint = endpoint
        self.body = body
        self.size = size
        """The body's size in bytes: what bounds rendering it on the event loop (None: not
        known, never on the loop)."""
        self.renderers = renderers
        self._tokens: dict[str, Sequence[int] | None] = {}
        self._keys: dict[bytes, PromptKeys | None] = {}
        self.keying_s = 0.0
        """Time spent computing this request's tokens and keys (each computed once)."""

    async def keys(self, ns: NamespaceInfo | None) -> PromptKeys | None:
        if ns is None or self.body is None:
            return None
        if ns.fingerprint not in self._keys:
            start = time.perf_counter()
            tokens = await self.tokens(ns.tokenizer)
            self._keys[ns.fingerprint] = None if tokens is None else PromptKeys(
                ns, len(tokens), tuple(chunk_keys(ns.fingerprint, tokens, ns.chunk_tokens,
                                                  extras_of(self.body))))
            self.keying_s += time.perf_counter() - start
        return self._keys[ns.fingerprint]

    async def tokens(self, tokenizer: str) -> Sequence[int] | None:
        ids = self._given_ids()
        if ids is not None:
            return ids
        if self.endpoint == "chat" and self.body is not None and brings_own_template(self.body):
            return None  # the client's own Jinja: not even handed to a thread
        if tokenizer not in self._tokens:
            renderer = await self.renderers.get(tokenizer)
            self._tokens[tokenizer] = None if renderer is None else await self._encode(renderer)
        return self._tokens[tokenizer]

    async def _encode(self, renderer: PromptRenderer) -> Sequence[int] | None:
        """On the event loop when it is cheap (a small body whose text the tokenizer has
        mostly seen: a conversation's next turn), in a thread otherwise. A thread costs two
        wake-ups and a wait for the GIL, milliseconds on a machine whose cores the engines
        keep busy; work a client can make long must never hold the loop."""
        if self.body is None:
            return None
        body = dict(self.body)
        if (self.size is None or self.size > INLINE_BODY_BYTES
                or _parts(body) > INLINE_PARTS):
            return await asyncio.to_thread(renderer.ids, self.endpoint, body)
        encoding = renderer.prepare(self.endpoint, body)
        if encoding is None:
            return None
        if encoding.cost_chars <= INLINE_CHARS:
            return finish(encoding)
        return await asyncio.to_thread(finish, encoding)

    def _given_ids(self) -> list[int] | None:
        """A completion prompt given as token ids needs no tokenizer."""
        if self.endpoint != "completions" or self.body is None:
            return None
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if (isinstance(prompt, list) and prompt
                and all(type(t) is int for t in prompt)):
            return list(prompt)
        return None


def _parts(body: Mapping[str, Any]) -> int:
    """A chat body's messages and content parts (0 for a completion)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return len(messages) + sum(len(m["content"]) for m in messages
                               if isinstance(m, dict) and isinstance(m.get("content"), list))
