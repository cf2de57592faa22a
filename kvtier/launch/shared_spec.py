"""``kvtier serve --shared SPEC``: one shared tier for every instance of the stack.

=========================================================  ==================================
SPEC                                                       tier (``name: shared``)
=========================================================  ==================================
a folder (``/mnt/nfs/kvtier``, ``file:///...``; default    ``fs`` on that folder
``~/.cache/kvtier/shared``)
``s3://BUCKET/PREFIX?endpoint=URL&region=R``               ``s3``: ``bucket``, ``prefix``,
``&credentials=env|profile:NAME|file:PATH&create_bucket=1``  ``endpoint_url``, ``tls`` (from the
                                                           endpoint's scheme), ``region``,
                                                           ``credentials``, ``create_bucket``
``redis://HOST:PORT/DB?key_prefix=P&password_env=VAR``     ``redis``: ``url``, ``key_prefix``,
(``rediss://`` for TLS)                                    ``password_env``
``none``                                                   no shared tier (each instance alone)
=========================================================  ==================================

Secrets never go in SPEC: S3 keys come from the environment (or a profile / key file), a
Redis password from the variable ``password_env`` names (see docs/shared.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvtier.errors import ConfigError

NAME = "shared"
_S3_QUERY = {"endpoint": "endpoint_url", "region": "region", "credentials": "credentials",
             "create_bucket": "create_bucket", "addressing": "addressing"}
_REDIS_QUERY = {"key_prefix": "key_prefix", "password_env": "password_env",
                "username": "username"}
_TRUE = {"1", "true", "yes", "on"}


def default_shared_path() -> Path:
    from kvtier.demo.model import default_cache_dir

    return default_cache_dir() / "shared"


def shared_tier(spec: str | None, capacity_bytes: int) -> dict[str, Any] | None:
    """The tier config (as in ``server.yaml``'s ``tiers``) for ``--shared SPEC``; None for
    ``none``. Raises ConfigError naming ``--shared`` for a malformed SPEC or a tier type
    this kvtier does not have."""
    if spec is not None and spec.lower() in ("none", "off"):
        return None
    text = spec or str(default_shared_path())
    url = urlsplit(text)
    if url.scheme in ("", "file"):
        tier_type, options = "fs", {"path": str(Path(url.path or text).expanduser())}
    elif url.scheme == "s3":
        tier_type, options = "s3", _s3_options(url.netloc, url.path, parse_qs(url.query))
    elif url.scheme in ("redis", "rediss"):
        base = f"{url.scheme}://{url.netloc}{url.path}"
        tier_type, options = "redis", {"url": base, **_query(parse_qs(url.query),
                                                             _REDIS_QUERY)}
    else:
        raise ConfigError(f"--shared: expected a folder, s3://BUCKET/PREFIX?endpoint=URL, "
                          f"redis://HOST:PORT/DB or none; got a {url.scheme}:// URL")
    _check_type(tier_type)
    return {"type": tier_type, "name": NAME, "capacity_bytes": capacity_bytes,
            "options": options}


def _s3_options(bucket: str, path: str, query: dict[str, list[str]]) -> dict[str, Any]:
    if not bucket:
        raise ConfigError("--shared: s3://BUCKET/PREFIX needs a bucket")
    options: dict[str, Any] = {"bucket": bucket}
    prefix = path.strip("/")
    if prefix:
        options["prefix"] = prefix + "/"
    options.update(_query(query, _S3_QUERY))
    if "create_bucket" in options:
        options["create_bucket"] = str(options["create_bucket"]).lower() in _TRUE
    endpoint = str(options.get("endpoint_url", ""))
    if endpoint.startswith("http://"):
        options["tls"] = False
    return options


def _query(query: dict[str, list[str]], known: dict[str, str]) -> dict[str, Any]:
    unknown = sorted(set(query) - set(known))
    if unknown:
        raise ConfigError(f"--shared: unknown parameter {unknown[0]!r}; known: "
                          f"{', '.join(sorted(known))}")
    return {known[name]: values[-1] for name, values in query.items()}


def _check_type(tier_type: str) -> None:
    from kvtier.tiers import TIERS

    if tier_type not in TIERS:
        raise ConfigError(f"--shared: this kvtier has no {tier_type!r} tier (it has: "
                          f"{', '.join(TIERS)}); use a folder, or a kvtier with the "
                          f"{tier_type} tier")
