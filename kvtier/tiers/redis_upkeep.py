"""The redis tier's upkeep transaction: dropping index entries of values Redis evicted or
expired (:meth:`~kvtier.tiers.redis.RedisTier.reconcile`).

It runs under WATCH, so an entry a writer re-creates meanwhile is kept. It raises
redis-py's errors; the tier runs it under its retry policy, which translates them.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import WatchError


def drop_if_gone(client: Any, index: str, sizes: str | None, gone: dict[bytes, str]) -> int:
    """Remove the members ``gone`` (member -> value key) from ``index`` (and ``sizes``) if
    none of their values exists; returns how many were dropped (0 if one came back)."""
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(*gone.values())
            if pipe.exists(*gone.values()):
                return 0  # one was written again meanwhile: keep the batch for now
            pipe.multi()
            pipe.zrem(index, *gone)
            if sizes is not None:
                pipe.hdel(sizes, *gone)
            pipe.execute()
        except WatchError:
            return 0
    return len(gone)
