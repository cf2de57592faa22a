"""What ``kvtier verify`` can see of the instances behind an entry point.

Per instance i (the i-th ``--kvtier-servers`` URL and the i-th ``--backends`` URL):

- its node server's HTTP API: ``/v1/stats`` (chunks per tier, which tiers are shared) and
  ``/metrics`` (``kvtier_hits_total{tier}``: chunks leased per tier; lookups served), asked
  with the node servers' bearer token when one is given;
- its vLLM's ``/metrics`` (``vllm:request_success_total``: requests it finished).

Comparing two :class:`Snapshot` s tells which instance served a request (the one whose vLLM
finished one more, else whose node server answered a lookup) and where its prefix came from.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.httpjson import HttpError, bearer, get_json, get_text

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
REQUESTS = "vllm:request_success_total"
HITS = "kvtier_hits_total"
LOOKUPS = "kvtier_request_seconds_count"


def counters(text: str, names: Sequence[str]) -> dict[str, float]:
    """Prometheus counters ``names``, summed over labels except ``tier`` / ``op``:
    ``name`` or ``name|value``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match or match.group(1) not in names:
            continue
        name, labels, value = match.groups()
        label = dict(_LABEL.findall(labels or ""))
        sub = label.get("tier") or label.get("op")
        key = f"{name}|{sub}" if sub else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class InstanceView:
    index: int
    node: str | None = None
    backend: str | None = None
    node_token: str | None = field(default=None, repr=False)
    """The node servers' bearer token (never shown)."""

    @property
    def node_headers(self) -> dict[str, str]:
        return bearer(self.node_token)

    def node_json(self, path: str) -> Any:
        """``path`` of the node server's HTTP API, with the token (HttpError if refused)."""
        return get_json(f"{self.node}{path}", headers=self.node_headers)

    def stats(self) -> dict[str, Any] | None:
        return None if self.node is None else self.stats_or_error()[0]

    def stats_or_error(self) -> tuple[dict[str, Any] | None, str]:
        """The node server's ``/v1/stats``, or why not (a 401 names the token options)."""
        try:
            doc = self.node_json("/v1/stats")
        except HttpError as exc:
            if exc.status == 401:
                how = ("a wrong node token" if self.node_token else "no node token")
                return None, (f"{self.node}: 401, {how} (give --node-token-env VAR or "
                              "--node-token-file FILE)")
            return None, str(exc)
        if not isinstance(doc, dict):
            return None, f"{self.node}/v1/stats: not a JSON object"
        return doc, ""

    def shared_tiers(self) -> dict[str, dict[str, Any]]:
        tiers = (self.stats() or {}).get("tiers") or {}
        return {name: doc for name, doc in tiers.items()
                if isinstance(doc, dict) and doc.get("shared")}

    def sample(self) -> dict[str, float]:
        """Counters now; one that cannot be read is left out (the delta is then unknown,
        which :func:`served_by` reports as such)."""
        out: dict[str, float] = {}
        if self.node is not None:
            with contextlib.suppress(HttpError):
                out.update(counters(get_text(f"{self.node}/metrics",
                                             headers=self.node_headers), (HITS, LOOKUPS)))
            for name, doc in self.shared_tiers().items():
                out[f"chunks|{name}"] = float(doc.get("chunks", 0))
        if self.backend is not None:
            with contextlib.suppress(HttpError):
                out.update(counters(get_text(f"{self.backend}/metrics"), (REQUESTS,)))
        return out


@dataclass
class Snapshot:
    samples: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def take(cls, views: Sequence[InstanceView]) -> Snapshot:
        return cls([v.sample() for v in views])


def rise(before: Snapshot, after: Snapshot, i: int, key: str) -> float:
    return after.samples[i].get(key, 0.0) - before.samples[i].get(key, 0.0)


def served_by(before: Snapshot, after: Snapshot) -> int | None:
    """The one instance that served a request between the snapshots (None: unknown)."""
    n = len(after.samples)
    for key in (REQUESTS, f"{LOOKUPS}|lookup"):
        risen = [i for i in range(n) if rise(before, after, i, key) > 0]
        if len(risen) == 1:
            return risen[0]
    return None


def hits_by_tier(before: Snapshot, after: Snapshot, i: int) -> dict[str, int]:
    """Chunks instance ``i``'s node server leased between the snapshots, by tier."""
    tiers = {k.split("|", 1)[1] for k in after.samples[i] if k.startswith(HITS + "|")}
    out = {t: int(rise(before, after, i, f"{HITS}|{t}")) for t in sorted(tiers)}
    return {t: n for t, n in out.items() if n > 0}


def chunk_files(path: Path) -> int:
    """Chunk files in a shared folder (an ``fs`` tier: ``chunks/<ns>/<kk>/<key>.kvc``)."""
    root = path / "chunks"
    return sum(1 for _ in root.rglob("*.kvc")) if root.is_dir() else 0
