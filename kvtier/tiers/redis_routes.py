"""The redis tier's calls, each sent to the node that serves its key's slot (one server, or a
cluster's primary: :mod:`~kvtier.tiers.redis_nodes`), under the tier's retry policy
(:class:`~kvtier.tiers.redis_client.Calls`), redirects followed and bounded.

A MOVED reloads the cluster's map and sends the call again; an ASK (a slot being migrated)
runs a single-slot transaction again with ASKING on the node named, which must be on the map;
anything else that meets an ASK counts it as a MOVED. After :data:`MAX_REDIRECTS` a call fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar, cast

import redis
from redis.exceptions import AskError, MovedError, RedisError, ResponseError

from kvtier.tiers.redis_client import Calls
from kvtier.tiers.redis_index import is_wrongtype
from kvtier.tiers.redis_nodes import ClusterNodes, SingleNode
from kvtier.tiers.redis_repair import run_typed
from kvtier.tiers.redis_upkeep import drop_if_gone
from kvtier.tiers.redis_wire import Arg, transaction
from kvtier.tiers.skips import Skips

T = TypeVar("T")
BATCH = 512
"""Index entries per ZSCAN page, HMGET and EXISTS round trip."""
MAX_REDIRECTS = 3
"""MOVED / ASK replies followed for one call before it fails (a slot moving back and forth)."""


class Bounded(NamedTuple):
    """A value read no further than a limit: its whole length, and its first bytes."""

    size: int
    data: bytes


class Routes:
    """One tier's way to its nodes: ``nodes`` for where, ``calls`` for the retry policy and
    kvtier's errors, ``skips`` for values of another type met on the way."""

    def __init__(self, nodes: SingleNode | ClusterNodes, calls: Calls, skips: Skips) -> None:
        self.nodes = nodes
        self.calls = calls
        self.skips = skips

    def at(self, key: str, what: str, call: Callable[[redis.Redis], T], *,
            asking: Callable[[redis.Redis], T] | None = None) -> T:
        """``call(client)`` on the node that serves ``key``, under the retry policy. A MOVED
        reloads the cluster's map and tries again; an ASK runs ``asking`` on the node named
        (where given; else it counts as a MOVED); at most :data:`MAX_REDIRECTS` of them."""
        def attempt() -> T:
            asked: redis.Redis | None = None
            for _ in range(MAX_REDIRECTS + 1):
                try:
                    if asked is not None and asking is not None:
                        return asking(asked)
                    return call(self.nodes.client_for(key))
                except AskError as exc:  # MovedError is one too
                    asked = None
                    if isinstance(exc, MovedError) or asking is None:
                        self.nodes.moved(exc)
                    else:
                        asked = self.nodes.asking(exc)
            raise redis.ConnectionError(f"{key}: still redirected after {MAX_REDIRECTS} "
                                        "redirects (its slot is moving)")
        return self.calls.run(what, attempt)

    def exec(self, key: str, what: str, commands: list[tuple[Arg, ...]], *,
              raise_errors: bool = True) -> list[Any]:
        """``commands`` (all on ``key``'s slot) in one MULTI/EXEC round trip."""
        return self.at(key, what, lambda c: transaction(
            c.connection_pool, commands, raise_errors=raise_errors), asking=lambda c: transaction(
            c.connection_pool, commands, raise_errors=raise_errors, asking=True))

    def exec_typed(self, key: str, what: str, commands: list[tuple[Arg, ...]],
                   typed: dict[str, str]) -> list[Any]:
        """:meth:`exec`, and where a command meets a value of another type under one of the
        keys ``typed`` (key -> the type it must have, all on ``key``'s slot), that value is
        deleted and the commands run once more, all on the node that serves the slot
        (:func:`~kvtier.tiers.redis_repair.run_typed`)."""
        return self.at(key, what, lambda c: run_typed(
            c.connection_pool, commands, typed, self.skips), asking=lambda c: run_typed(
            c.connection_pool, commands, typed, self.skips, asking=True))

    def batch(self, key: str, what: str, queue: Callable[[Any], object], *,
               raise_on_error: bool = True) -> list[Any]:
        """``queue(pipe)`` adds commands for keys on ``key``'s node; they run pipelined, not
        atomically. Without ``raise_on_error`` a refused command's error is its reply."""
        def call(client: redis.Redis) -> list[Any]:
            with client.pipeline(transaction=False) as pipe:
                queue(pipe)
                replies = pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, AskError) or (raise_on_error
                                                   and isinstance(reply, RedisError)):
                    raise reply
            return replies
        return self.at(key, what, call)

    def each(self, keys: list[str], what: str, command: Callable[[Any, str], object]
              ) -> list[Any]:
        """``command(pipe, key)`` for each of ``keys`` (any slots), pipelined per node; the
        replies in the order of ``keys``, a refused command's error as its reply."""
        def groups() -> dict[int, list[int]]:
            by_node: dict[int, list[int]] = {}
            for i, key in enumerate(keys):
                by_node.setdefault(id(self.nodes.client_for(key)), []).append(i)
            return by_node
        replies: list[Any] = [None] * len(keys)
        for group in self.calls.run(what, groups).values():
            def queue(pipe: Any, group: list[int] = group) -> None:
                for i in group:
                    command(pipe, keys[i])
            got = self.batch(keys[group[0]], what, queue, raise_on_error=False)
            for i, reply in zip(group, got, strict=True):
                replies[i] = reply
        return replies

    def bounded_get(self, name: str, limit: int, what: str, *,
                     exists: bool = False) -> Bounded | None:
        """The value's length and at most its first ``limit`` bytes, in one MULTI/EXEC
        round trip (as fast as a GET, measured: a Lua script doing the same is 40% slower),
        so a value over ``limit`` is never transferred. ``None``: a value of another type
        (skipped, counted), or, with ``exists``, no value at all."""
        commands: list[tuple[Arg, ...]] = [(b"STRLEN", name)]
        if limit > 0:  # GETRANGE 0 -1 would be the whole value
            commands.append((b"GETRANGE", name, 0, limit - 1))
        if exists:
            commands.append((b"EXISTS", name))
        replies = self.exec(name, what, commands, raise_errors=False)
        for reply in replies:
            if is_wrongtype(reply):
                self.skips.add("values of another type", where=name)
                return None
            if isinstance(reply, RedisError):
                raise self.calls.translate(reply, what) from reply
        if exists and not replies[-1]:
            return None
        return Bounded(int(replies[0]), bytes(replies[1]) if limit > 0 else b"")

    def zscan(self, index: str, what: str, *, start: int = 0
              ) -> Iterator[list[tuple[bytes, float]]]:
        """ZSCAN pages from cursor ``start``; a key of another type under ``index`` has none
        (skipped, counted)."""
        cursor = start
        while True:
            def step(client: redis.Redis, at: int = cursor
                     ) -> tuple[int, list[tuple[bytes, float]]]:
                try:
                    return cast(tuple[int, list[tuple[bytes, float]]],
                                client.zscan(index, at, count=BATCH))
                except ResponseError as exc:
                    if not is_wrongtype(exc):
                        raise
                    self.skips.add("index keys of another type", where=index)
                    return 0, []
            cursor, page = self.at(index, what, step)
            yield page
            if cursor == 0:
                return

    def drop_vanished(self, index: str, sizes: str | None, keys: dict[bytes, str]) -> int:
        """``keys`` (member -> value key) all share ``index``'s slot."""
        if not keys:
            return 0
        there = self.batch(index, "checking indexed keys", lambda pipe: [
            pipe.exists(k) for k in keys.values()])
        gone = {m: k for (m, k), n in zip(keys.items(), there, strict=True) if not n}
        if not gone:
            return 0
        return self.at(index, "dropping vanished index entries",
                        lambda client: drop_if_gone(client, index, sizes, gone))

