"""One client request as the router handles it: its bytes, what routing reads from its body,
and (lazily) its prompt's keys."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvtier.router.keys import NamespaceInfo, PromptKeys, Renderers, RequestKeys

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


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

    @classmethod
    def parse(cls, path: str, raw: bytes, session_header: str | None,
              renderers: Renderers) -> RoutedRequest:
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = None
        body = doc if isinstance(doc, dict) else None
        endpoint = ENDPOINTS[path]
        session = session_header
        if not session and body is not None and isinstance(body.get("user"), str):
            session = body["user"] or None
        return cls(path, endpoint, raw, body, session, RequestKeys(endpoint, body, renderers))

    @property
    def model(self) -> str | None:
        model = self.body.get("model") if self.body is not None else None
        return model if isinstance(model, str) else None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream")) if self.body is not None else False

    async def keys(self, ns: NamespaceInfo | None) -> PromptKeys | None:
        return await self.keys_of.keys(ns)
