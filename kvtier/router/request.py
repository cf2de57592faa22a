"""One client request as the router handles it: its bytes (read up to a cap), its tenant's
rules applied to its body, what routing reads from it, and (lazily) its prompt's keys.

The keys are computed from the body as the backend gets it — after the tenant's salt went in
— so they are the keys the engine computes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtier.router.keys import NamespaceInfo, PromptKeys, Renderers, RequestKeys
from kvtier.router.tenants import OPEN, BadRequest, Tenant, Tenants, stamp_tenant

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class BodyTooLarge(Exception):
    """The body is over ``--max-body-bytes`` (answered with 413)."""

    def __init__(self, cap: int, declared: int | None) -> None:
        said = f"Content-Length {declared}" if declared is not None else "the body"
        super().__init__(f"request body too large: {said} is over the limit of {cap} bytes "
                         "(--max-body-bytes)")


async def read_body(request: web.Request, cap: int) -> bytes:
    """The body, refused before reading when its Content-Length is over ``cap`` and as soon
    as the bytes received pass it (chunked bodies): never more than ``cap`` (plus one read)
    in memory."""
    declared = request.content_length
    if declared is not None and declared > cap:
        raise BodyTooLarge(cap, declared)
    body = bytearray()
    async for chunk in request.content.iter_any():
        if len(body) + len(chunk) > cap:
            raise BodyTooLarge(cap, None)
        body += chunk
    return bytes(body)


@dataclass
class RoutedRequest:
    path: str
    endpoint: str
    raw: bytes
    body: dict[str, Any] | None
    """The JSON body, or None if it is not a JSON object (forwarded as is, the backend
    answers it)."""
    session: str | None
    keys_of: RequestKeys
    tenant: Tenant = OPEN
    session_key: bytes | None = None
    """The session the router holds for it (:mod:`kvtier.router.sessions`), if any."""

    @classmethod
    def parse(cls, path: str, raw: bytes, session_header: str | None,
              renderers: Renderers, tenant: Tenant = OPEN,
              tenants: Tenants | None = None) -> RoutedRequest:
        """Raises :class:`BadRequest` when the tenant's rules cannot be applied."""
        try:
            doc = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            doc = None
        body = doc if isinstance(doc, dict) else None
        if tenants is not None and tenant.enforced:
            if body is None:
                raise BadRequest("the body must be a JSON object")
            try:
                if tenants.enforce(tenant, body):
                    raw = json.dumps(body).encode()
            except RecursionError as exc:
                raise BadRequest("the body is nested too deeply") from exc
        elif body is not None and stamp_tenant(body, tenant):
            raw = json.dumps(body).encode()
        endpoint = ENDPOINTS[path]
        session = session_header
        if not session and body is not None and isinstance(body.get("user"), str):
            session = body["user"] or None
        keys = RequestKeys(endpoint, body, renderers, len(raw))
        return cls(path, endpoint, raw, body, session, keys, tenant)

    def rewritten(self, renderers: Renderers) -> None:
        """The body was changed in place: its bytes (and what keys them) follow."""
        assert self.body is not None
        self.raw = json.dumps(self.body).encode()
        self.keys_of = RequestKeys(self.endpoint, self.body, renderers, len(self.raw))

    @property
    def model(self) -> str | None:
        model = self.body.get("model") if self.body is not None else None
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream")) if self.body is not None else False

    async def keys(self, ns: NamespaceInfo | None) -> PromptKeys | None:
        return await self.keys_of.keys(ns)
