"""Small JSON-over-HTTP calls with the standard library (OpenAI-compatible servers, node
servers' HTTP APIs), for the CLI tools that must not need an HTTP client package."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any


class HttpError(Exception):
    """A request that got no answer, or an answer with an error status."""

    def __init__(self, url: str, status: int | None, detail: str) -> None:
        super().__init__(f"{url}: {status or 'no answer'} {detail}".strip())
        self.url = url
        self.status = status


def request(url: str, body: Mapping[str, Any] | None = None, *, timeout_s: float = 30.0,
            headers: Mapping[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as exc:
        raise HttpError(url, exc.code, exc.read().decode(errors="replace")[:500]) from exc
    except (OSError, urllib.error.URLError) as exc:
        raise HttpError(url, None, str(exc)) from exc


def get_json(url: str, *, timeout_s: float = 10.0,
             headers: Mapping[str, str] | None = None) -> Any:
    return _json(url, request(url, timeout_s=timeout_s, headers=headers))


def post_json(url: str, body: Mapping[str, Any], *, timeout_s: float = 300.0,
              headers: Mapping[str, str] | None = None) -> Any:
    return _json(url, request(url, body, timeout_s=timeout_s, headers=headers))


def get_text(url: str, *, timeout_s: float = 10.0,
             headers: Mapping[str, str] | None = None) -> str:
    return request(url, timeout_s=timeout_s, headers=headers).decode(errors="replace")


def bearer(token: str | bytes | None) -> dict[str, str]:
    """The ``Authorization`` header for ``token`` ({} without one)."""
    if not token:
        return {}
    return {"Authorization": "Bearer " + (token.decode() if isinstance(token, bytes)
                                          else token)}


def _json(url: str, raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text) if text.strip() else {}
    except ValueError as exc:
        raise HttpError(url, 200, f"not JSON: {text[:200]}") from exc


def wait_models(base: str, alive: Callable[[], bool], timeout_s: float,
                headers: Mapping[str, str] | None = None) -> str | None:
    """The first model an OpenAI-compatible server at ``base`` lists, once it answers;
    None if ``alive()`` turns false or it does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        try:
            return str(get_json(f"{base}/v1/models", timeout_s=5, headers=headers)
                       ["data"][0]["id"])
        except (HttpError, KeyError, IndexError, TypeError):
            time.sleep(0.5)
    return None
