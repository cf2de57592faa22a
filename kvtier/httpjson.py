"""Small JSON-over-HTTP calls with the standard library (OpenAI-compatible servers, node
servers' HTTP APIs), for the CLI tools that must not need an HTTP client package; and the
probes that tell whether a server kvtier started answers yet."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kvtier.processes import wait_ready


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


def http_status(url: str, *, method: str = "GET", timeout_s: float = 2.0) -> int | None:
    """The HTTP status ``url`` answers (its body read up to 64 KiB); None if nothing answers
    in time. Any status counts as an answer: the caller decides which mean "ready"."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                      timeout=timeout_s)
    try:
        conn.request(method, parts.path or "/")
        resp = conn.getresponse()
        resp.read(64 * 1024)
        return resp.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def answers_200(url: str, timeout_s: float = 5.0) -> Callable[[], bool]:
    """A readiness probe: does ``GET url`` answer 200 now?"""
    return lambda: http_status(url, timeout_s=timeout_s) == 200


def first_model(base: str, headers: Mapping[str, str] | None = None) -> str | None:
    """The first model an OpenAI-compatible server at ``base`` lists; None if it does not
    answer (yet) or lists none."""
    try:
        return str(get_json(f"{base}/v1/models", timeout_s=5, headers=headers)
                   ["data"][0]["id"])
    except (HttpError, KeyError, IndexError, TypeError):
        return None


def wait_models(base: str, alive: Callable[[], bool], timeout_s: float,
                headers: Mapping[str, str] | None = None) -> str | None:
    """The first model an OpenAI-compatible server at ``base`` lists, once it answers;
    None if ``alive()`` turns false or it does not answer within ``timeout_s``."""
    return wait_ready(lambda: first_model(base, headers), timeout_s=timeout_s, alive=alive)
