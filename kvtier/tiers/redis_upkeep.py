"""The redis tier's upkeep transactions: dropping index entries of values Redis evicted or
expired, and forgetting namespaces left empty (:meth:`~kvtier.tiers.redis.RedisTier.reconcile`).

Each runs under WATCH, so an entry a writer re-creates meanwhile is kept. They raise
redis-py's errors; the tier runs them under its retry policy, which translates them.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ResponseError, WatchError

from kvtier.tiers.redis_index import is_wrongtype


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


def forget_if_empty(client: Any, index: str, sizes: str, namespaces: str, ns: str) -> None:
    """Remove ``ns`` from the namespace set, and its size hash, if its index is empty."""
    with client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(index)
            if pipe.zcard(index) == 0:
                pipe.multi()
                pipe.srem(namespaces, ns)
                pipe.delete(sizes)
                pipe.execute()
        except WatchError:
            pass  # written meanwhile: not empty
        except ResponseError as exc:
            if not is_wrongtype(exc):
                raise
            # another program's value under the index's name: nothing to forget
