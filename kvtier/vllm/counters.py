"""The connector's counters: one flat dict of numbers, summed across workers and steps.

A key is a metric name, optionally ``name|tier`` for the metrics labelled by tier. vLLM moves
the dict from the workers and the scheduler to its frontend (``KVConnectorStats.data``), where
:mod:`kvtier.vllm.stats` logs it and turns it into Prometheus counters named
``vllm:kvtier_<name>``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

METRICS: dict[str, tuple[str, bool]] = {
    # name: (help, labelled by tier)
    "query_tokens": ("Prompt tokens looked up in kvtier beyond vLLM's own prefix cache, "
                     "hit or miss (once per request)", False),
    "hit_tokens": ("Of those, tokens kvtier leased for loading at the request's first "
                   "admission, by tier", True),
    "loaded_tokens": ("Tokens loaded into vLLM's KV cache, by the tier they came from", True),
    "failed_load_tokens": ("Tokens whose load failed (missing, corrupt, late): recomputed",
                           False),
    "skipped_slower_than_recompute": ("Hit tokens recomputed because loading them would "
                                      "have been slower, by tier", True),
    "cancelled_loads": ("Loads dropped because their request ended first (e.g. aborted)",
                        False),
    "shared_load_waits": ("Requests that waited for another request's load of their prefix "
                          "(forks: the same context sent at once), to share its blocks",
                          False),
    "stored_chunks": ("Chunks stored into kvtier (committed)", False),
    "skipped_store_chunks": ("Chunks not stored: present, stored by another engine, or no room",
                             False),
    "failed_store_chunks": ("Chunks a worker could not copy (aborted)", False),
    "server_unavailable": ("Connector calls that found the kvtier server unreachable", False),
    "load_bytes": ("Bytes copied from arena slots into vLLM's KV cache", False),
    "load_seconds": ("Worker time spent copying loads", False),
    "store_bytes": ("Bytes copied from vLLM's KV cache into arena slots", False),
    "store_seconds": ("Worker time spent copying stores", False),
    "arena_pinned": ("Arena mappings a worker registered as pinned memory (CUDA)", False),
    "arena_pageable": ("Arena mappings a worker could not pin: copies are correct but slower "
                       "and may block the worker (CUDA)", False),
    "flushed_stores": ("Store batches a worker waited for before a forward because vLLM "
                       "reused their blocks (CUDA)", False),
}


def key(name: str, tier: str | None = None) -> str:
    if name not in METRICS:
        raise KeyError(f"unknown kvtier counter {name!r}")
    return f"{name}|{tier}" if tier else name


def split(data_key: str) -> tuple[str, str | None]:
    name, _, tier = data_key.partition("|")
    return name, tier or None


class Counters:
    """Accumulates counts between two ``take()`` calls."""

    def __init__(self) -> None:
        self._data: dict[str, float] = {}
        self._unreported: dict[str, float] = {}

    def add(self, name: str, value: float = 1, tier: str | None = None) -> None:
        if value:
            k = key(name, tier)
            self._data[k] = self._data.get(k, 0) + value
            self._unreported[k] = self._unreported.get(k, 0) + value

    def take_unreported(self) -> dict[str, float]:
        """Increments since the last call: what the node server has not been told yet
        (independent of ``take``, which feeds vLLM's own stats)."""
        data, self._unreported = self._unreported, {}
        return data

    def take(self) -> dict[str, float]:
        data, self._data = self._data, {}
        return data

    def __bool__(self) -> bool:
        return bool(self._data)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)


def merged(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
