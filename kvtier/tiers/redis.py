"""The ``redis`` tier: chunks as values on a Redis or Valkey server that every node reaches.

Keys (``P`` is ``options.key_prefix``, default ``kvtier:``; hex of fingerprints and keys only)::

    P c:<ns>:<key>      string   one sealed chunk (header page + payload), written whole by SET
    P z:<ns>            zset     the namespace's index: member <key>, score = last write or
                                 touch (unix seconds): listed and ordered without SCAN
    P s:<ns>            hash     <key> -> the chunk's estimated footprint in Redis's memory
                                 (:func:`~kvtier.tiers.redis_memory.footprint`), for budgets
    P ns                set      namespaces that have (had) chunks
    P n:<name>          string   a note (journal, heartbeats)
    P nz                zset     note names, score 0: listed in order with ZRANGEBYLEX

A write or delete changes a chunk and its index entries in one MULTI/EXEC, so a reader or a
listing sees both or neither. A GET refreshes Redis's own LRU clock; ``touch`` moves the index
score (and the TTL with ``chunk_ttl_s``). Redis may evict or expire chunks itself
(docs/shared.md): the index then names chunks that are gone. A read of one is a miss, the
listing may still report it until :meth:`RedisTier.reconcile` (run by the sweeper through
``clean_stale_temps``) drops such entries in batches. An evicted index or note structure loses
listings, never bytes: nothing here trusts the index for what a read returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from redis.exceptions import WatchError

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import ChunkTooLarge, TierIOError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.redis_client import Calls, make_client
from kvtier.tiers.redis_memory import (
    UNKNOWN,
    EvictionFacts,
    eviction_warning,
    footprint,
    read_facts,
)
from kvtier.tiers.redis_options import load_password, parse_options
from kvtier.tiers.redis_wire import transaction
from kvtier.tiers.shared import (
    NAMESPACE_HEX,
    SharedTier,
    check_note_name,
    key_hex,
    namespace_hex,
    split_options,
)

log = logging.getLogger(__name__)
BATCH = 512
"""Index entries per ZSCAN page, HMGET and EXISTS round trip."""


@dataclass(frozen=True)
class Layout:
    """Key names under one prefix (see the module docstring)."""

    prefix: str

    def chunk(self, ns: str, key: str) -> str:
        return f"{self.prefix}c:{ns}:{key}"

    def index(self, ns: str) -> str:
        return f"{self.prefix}z:{ns}"

    def sizes(self, ns: str) -> str:
        return f"{self.prefix}s:{ns}"

    def note(self, name: str) -> str:
        return f"{self.prefix}n:{name}"

    @property
    def namespaces(self) -> str:
        return f"{self.prefix}ns"

    @property
    def notes(self) -> str:
        return f"{self.prefix}nz"


class RedisTier(SharedTier):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        own, self.sharing = split_options(config.options, where)
        self.options = parse_options(own, where)
        self.endpoint = self.options.endpoint
        password = load_password(self.options, where)
        self.client = make_client(self.options, password)
        self.calls = Calls(name, self.options, password)
        self.layout = Layout(self.options.key_prefix)
        ttl = self.options.chunk_ttl_s
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        self.facts = self._read_facts()

    def _read_facts(self) -> EvictionFacts:
        try:
            facts = self.calls.run("reading maxmemory", lambda: read_facts(self.client))
        except TierIOError as exc:  # down now: the store's breaker decides when to use it
            log.warning("%s (at start; the tier is used once Redis answers)", exc)
            return UNKNOWN
        if facts == UNKNOWN:
            log.info("redis tier %s (%s): CONFIG GET refused: maxmemory and its policy unknown",
                     self.name, self.endpoint.redacted())
        warning = eviction_warning(facts, self.config.capacity_bytes, self.options.chunk_ttl_s)
        if warning:
            log.warning("redis tier %s (%s): %s", self.name, self.endpoint.redacted(), warning)
        return facts

    def _run(self, what: str, call: Callable[[], Any]) -> Any:
        return self.calls.run(what, call)

    def _transaction(self, what: str, queue: Callable[[Any], object]) -> list[Any]:
        """``queue(pipe)`` adds commands; they run in one MULTI/EXEC round trip."""
        def call() -> list[Any]:
            with self.client.pipeline(transaction=True) as pipe:
                queue(pipe)
                return pipe.execute()
        return cast(list[Any], self._run(what, call))

    def _batch(self, what: str, queue: Callable[[Any], object]) -> list[Any]:
        """``queue(pipe)`` adds commands; they run pipelined, not atomically."""
        def call() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                queue(pipe)
                return pipe.execute()
        return cast(list[Any], self._run(what, call))

    # ------------------------------------------------------------------ chunks

    def footprint(self, nbytes: int) -> int:
        return footprint(nbytes)

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        header = codec.ChunkHeader.unpack(view[: codec.USED_HEADER_BYTES])
        ns, hexkey = namespace_hex(header.namespace_fp), key_hex(key)
        expiry = () if self._ttl_ms is None else (b"PX", self._ttl_ms)
        stored = footprint(len(view))
        commands = [(b"SET", self.layout.chunk(ns, hexkey), view, *expiry),
                    (b"ZADD", self.layout.index(ns), time.time(), hexkey),
                    (b"HSET", self.layout.sizes(ns), hexkey, stored),
                    (b"SADD", self.layout.namespaces, ns)]
        pool = self.client.connection_pool
        self._run(f"writing {hexkey[:16]}", lambda: transaction(pool, commands))
        return stored

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        hexkey = key_hex(key)
        name = self.layout.chunk(namespace_hex(namespace), hexkey)
        data = self._run(f"reading {hexkey[:16]}", lambda: self.client.get(name))
        if data is None:
            return None
        out = memoryview(dst).cast("B")
        if len(data) > len(out):
            raise ChunkTooLarge(f"redis tier {self.name}: chunk {hexkey[:16]} holds "
                                f"{len(data)} bytes, more than the {len(out)} expected")
        out[: len(data)] = data
        return len(data)

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        ns, hexkey = namespace_hex(namespace), key_hex(key)

        def queue(pipe: Any) -> None:
            pipe.delete(self.layout.chunk(ns, hexkey))
            pipe.zrem(self.layout.index(ns), hexkey)
            pipe.hdel(self.layout.sizes(ns), hexkey)

        self._transaction(f"deleting {hexkey[:16]}", queue)

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        self.delete(key, namespace=namespace)  # nothing is kept on a store others read

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        ns, hexkey = namespace_hex(namespace), key_hex(key)
        now = time.time()

        def queue(pipe: Any) -> None:
            pipe.zadd(self.layout.index(ns), {hexkey: now}, xx=True)  # never adds
            if self._ttl_ms is not None:
                pipe.pexpire(self.layout.chunk(ns, hexkey), self._ttl_ms)

        self._batch(f"touching {hexkey[:16]}", queue)

    def scan(self) -> Iterator[StoredChunk]:
        for namespace in self.namespaces():
            yield from self.scan_namespace(namespace)

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        """The index's entries (size, score as mtime, priority 35): may include chunks Redis
        evicted since (a read of one is a miss) until :meth:`reconcile` drops them."""
        ns = namespace_hex(namespace)
        seen: set[bytes] = set()  # ZSCAN may return an entry twice while Redis rehashes
        for page in self._zscan(self.layout.index(ns), "listing chunks"):
            fresh = [(m, s) for m, s in page if m not in seen and _is_key(m)]
            seen.update(m for m, _ in fresh)
            for member, score, size in self._sized(ns, fresh):
                yield StoredChunk(ChunkKey(bytes.fromhex(member.decode())), size, score, 35,
                                  namespace)

    def _zscan(self, index: str, what: str) -> Iterator[list[tuple[bytes, float]]]:
        cursor = 0
        while True:
            def step(at: int = cursor) -> tuple[int, list[tuple[bytes, float]]]:
                return cast(tuple[int, list[tuple[bytes, float]]],
                            self.client.zscan(index, at, count=BATCH))
            cursor, page = self._run(what, step)
            yield page
            if cursor == 0:
                return

    def _sized(self, ns: str, page: list[tuple[bytes, float]]
               ) -> Iterator[tuple[bytes, float, int]]:
        if not page:
            return
        members = [m for m, _ in page]
        sizes = self._run("listing sizes", lambda: self.client.hmget(
            self.layout.sizes(ns), members))
        lost = [m for m, size in zip(members, sizes, strict=True) if size is None]
        lengths: dict[bytes, int] = {}
        if lost:  # the size hash was evicted: ask the chunks (0 for one that is gone too)
            found = self._batch("reading lost sizes", lambda pipe: [
                pipe.strlen(self.layout.chunk(ns, m.decode())) for m in lost])
            lengths = dict(zip(lost, found, strict=True))
        for (member, score), size in zip(page, sizes, strict=True):
            if size is not None:
                yield member, float(score), int(size)
            elif lengths[member]:
                yield member, float(score), footprint(lengths[member])

    def namespaces(self) -> list[bytes]:
        listed = self._indexed_namespaces()
        counts = self._batch("counting chunks", lambda pipe: [
            pipe.zcard(self.layout.index(ns)) for ns in listed])
        return [bytes.fromhex(ns) for ns, n in zip(listed, counts, strict=True) if n]

    def _indexed_namespaces(self) -> list[str]:
        members = self._run("listing namespaces",
                            lambda: self.client.smembers(self.layout.namespaces))
        return sorted(m.decode() for m in members if NAMESPACE_HEX.fullmatch(m.decode()))

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        check_note_name(name)

        def queue(pipe: Any) -> None:
            pipe.set(self.layout.note(name), data)
            pipe.zadd(self.layout.notes, {name: 0})

        self._transaction(f"writing note {name}", queue)

    def get_note(self, name: str) -> bytes | None:
        key = self.layout.note(check_note_name(name))
        return cast(bytes | None, self._run(f"reading note {name}",
                                            lambda: self.client.get(key)))

    def list_notes(self, prefix: str, start_after: str = "") -> list[str]:
        """Every note name under ``prefix`` (at any depth), in order."""
        folder = check_note_name(prefix.rstrip("/")) + "/"
        low = f"({start_after}" if start_after >= folder else f"[{folder}"
        high = f"({folder[:-1]}0"  # '0' follows '/': the end of the folder's range
        names = self._run(f"listing notes {prefix}", lambda: self.client.zrangebylex(
            self.layout.notes, low, high))
        return [n.decode() for n in names if n.decode() > start_after]

    def delete_note(self, name: str) -> None:
        check_note_name(name)

        def queue(pipe: Any) -> None:
            pipe.delete(self.layout.note(name))
            pipe.zrem(self.layout.notes, name)

        self._transaction(f"deleting note {name}", queue)

    # ------------------------------------------------------------------ upkeep

    def clean_stale_temps(self, older_than_s: float) -> int:
        """Writes are single SETs, so there are no temporaries; the sweeper's call drops the
        index entries of chunks and notes Redis evicted or expired instead (any age)."""
        return self.reconcile()

    def reconcile(self) -> int:
        """Drop index entries whose chunk or note key no longer exists, in batches of
        :data:`BATCH`, and namespaces left empty; returns the entries dropped. Each batch is
        checked again under WATCH, so an entry a writer re-creates meanwhile is kept."""
        dropped = 0
        for ns in self._indexed_namespaces():
            index = self.layout.index(ns)
            for page in self._zscan(index, "reconciling the index"):
                members = [m for m, _ in page if _is_key(m)]
                dropped += self._drop_vanished(
                    index, self.layout.sizes(ns),
                    {m: self.layout.chunk(ns, m.decode()) for m in members})
            self._forget_if_empty(ns)
        for page in self._zscan(self.layout.notes, "reconciling notes"):
            dropped += self._drop_vanished(self.layout.notes, None,
                                           {m: self.layout.note(m.decode()) for m, _ in page})
        return dropped

    def _drop_vanished(self, index: str, sizes: str | None, keys: dict[bytes, str]) -> int:
        if not keys:
            return 0
        there = self._batch("checking indexed keys", lambda pipe: [
            pipe.exists(k) for k in keys.values()])
        gone = {m: k for (m, k), n in zip(keys.items(), there, strict=True) if not n}
        if not gone:
            return 0

        def drop() -> int:
            with self.client.pipeline(transaction=True) as pipe:
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

        return cast(int, self._run("dropping vanished index entries", drop))

    def _forget_if_empty(self, ns: str) -> None:
        index = self.layout.index(ns)

        def forget() -> None:
            with self.client.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(index)
                    if pipe.zcard(index) == 0:
                        pipe.multi()
                        pipe.srem(self.layout.namespaces, ns)
                        pipe.delete(self.layout.sizes(ns))
                        pipe.execute()
                except WatchError:
                    pass  # written meanwhile: not empty

        self._run("forgetting an empty namespace", forget)

    def describe(self) -> dict[str, Any]:
        source = ("password_env" if self.options.password_env else
                  "password_file" if self.options.password_file else
                  "url" if self.endpoint.password is not None else None)
        return {**super().describe(), "url": self.endpoint.redacted(), "shared": True,
                "key_prefix": self.options.key_prefix, "tls": self.endpoint.tls,
                "verify": self.options.verify, "password_source": source,
                "max_connections": self.options.max_connections,
                "chunk_ttl_s": self.options.chunk_ttl_s,
                "maxmemory": self.facts.maxmemory, "maxmemory_policy": self.facts.policy}

    def close(self) -> None:
        self.client.connection_pool.disconnect()
        self.client.close()


def _is_key(member: bytes) -> bool:
    return len(member) == 64 and NAMESPACE_HEX.fullmatch(member.decode("ascii", "replace")) \
        is not None

