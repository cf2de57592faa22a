"""Who is behind an entry point: ``kvtier verify --url`` of a ``kvtier route`` endpoint finds
the instances and their node servers by asking the router (``GET /kvtier/backends``), so the
five steps pass from the one URL a user knows. Another entry point (vllm-router, one
instance) does not answer it; verify then goes on with what it was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.httpjson import HttpError, get_json

BACKENDS_PATH = "/kvtier/backends"


@dataclass(frozen=True)
class Discovered:
    backends: tuple[str, ...]
    kvtier_servers: tuple[str, ...]
    """Same order; empty when the router knows no node server for some backend."""


def discover(url: str, headers: Mapping[str, str] | None = None,
             timeout_s: float = 5.0) -> Discovered | None:
    """The router's backends and node servers, or None when ``url`` does not list them
    (not a kvtier route, or an answer of the wrong shape). Redacted URLs (credentials in
    them: ``***@``) are left out: they cannot be called. ``headers``: the entry point's API
    key (the router does not ask for it here; another entry point may)."""
    try:
        doc = get_json(f"{url}{BACKENDS_PATH}", timeout_s=timeout_s, headers=headers)
    except HttpError:
        return None
    rows = doc.get("backends") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        return None
    backends: list[str] = []
    nodes: list[str] = []
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("url"), str):
            return None
        if "***@" in row["url"]:
            continue
        backends.append(row["url"].rstrip("/"))
        node = row.get("node")
        nodes.append(node.rstrip("/") if isinstance(node, str) and "***@" not in node else "")
    if not backends:
        return None
    servers = tuple(nodes) if all(nodes) else ()
    return Discovered(tuple(backends), servers)
