"""What ``kvtier serve`` shows on the terminal: a few lines, not the engine's logs.

vLLM's output goes to a log file whose path is printed; the terminal gets what serves where,
the tiers behind it, and (``--demo-request``) where each request's prompt came from.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from kvtier.config import ServerConfig

GiB = 1 << 30
MiB = 1 << 20


def size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.1f} GiB".replace(".0 ", " ")
    return f"{n / MiB:.0f} MiB"


def tier_where(tier_type: str, options: Mapping[str, Any]) -> str:
    """Where a tier keeps its chunks (never a secret: URLs are shown without a password)."""
    if "path" in options:
        return str(options["path"])
    if "bucket" in options:
        endpoint = options.get("endpoint_url") or "AWS"
        return f"s3://{options['bucket']}/{options.get('prefix', '')} at {endpoint}"
    if "url" in options:
        url = str(options["url"])
        if "@" in url:  # redis://user:pass@host: keep the host only
            scheme, _, rest = url.partition("://")
            url = f"{scheme}://{rest.rpartition('@')[2]}"
        return url
    return tier_type


def tiers_line(config: ServerConfig) -> str:
    parts = [f"arena {size(config.arena.size_bytes)} (host RAM)"]
    for tier in config.tiers:
        kind = tier.type if tier.type == tier.name else f"{tier.type} {tier.name!r}"
        parts.append(f"{kind} {size(tier.capacity_bytes)} in "
                     f"{tier_where(tier.type, tier.options)}")
    return " -> ".join(parts)


def say(text: str) -> None:
    """One line of kvtier's own terminal output."""
    print(text, file=sys.stdout, flush=True)
