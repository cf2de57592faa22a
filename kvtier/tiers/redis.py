"""The ``redis`` tier: chunks as values on a Redis or Valkey server, or a Redis Cluster, that
every node reaches. Key names: :mod:`~kvtier.tiers.redis_layout`; which node serves a key:
:mod:`~kvtier.tiers.redis_nodes`; calls, redirects and bounded reads:
:mod:`~kvtier.tiers.redis_routes`; notes: :mod:`~kvtier.tiers.redis_notes`.

A write or delete changes a chunk and its index entries in one MULTI/EXEC on one hash slot, so
a reader or a listing sees both or neither. A read (STRLEN + GETRANGE up to the reader's buffer,
one round trip) refreshes Redis's own LRU clock and never transfers a value larger than the
buffer or a note's cap; ``touch`` moves the index score (and the TTL with ``chunk_ttl_s``).
Redis may evict or expire chunks itself (docs/shared.md): the index then names chunks that are
gone. A read of one is a miss, the listing may still report it until :meth:`RedisTier.reconcile`
(run by the sweeper through ``clean_stale_temps``) drops such entries in batches. An evicted
index or note structure loses listings, never bytes: nothing here trusts the index for what a
read returns. Other programs may write under the prefix too: index entries that do not parse,
or sit in another key's bucket, are skipped and counted (:mod:`~kvtier.tiers.redis_index`),
never fail a listing.

The namespace set is written apart from the chunks (it lives on its own slot): a tier adds a
namespace before its first write into it and again every :data:`NAMESPACE_REFRESH_S`, so a
namespace that :meth:`RedisTier.reconcile` forgot while a peer wrote into it is listed again
within that time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, cast

import redis
from redis.exceptions import RedisError, ResponseError

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import ChunkTooLarge, TierIOError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.redis_client import Calls, make_nodes
from kvtier.tiers.redis_index import (
    hex_member,
    is_wrongtype,
    mtime_of,
    size_of,
)
from kvtier.tiers.redis_layout import BUCKETS, Layout, bucket_of
from kvtier.tiers.redis_memory import (
    UNKNOWN,
    EvictionFacts,
    combine,
    eviction_warning,
    footprint,
    read_facts,
)
from kvtier.tiers.redis_notes import Notes
from kvtier.tiers.redis_options import load_password, parse_options
from kvtier.tiers.redis_routes import BATCH, Routes
from kvtier.tiers.redis_upkeep import drop_if_gone
from kvtier.tiers.shared import (
    MAX_LISTED_NOTES,
    MAX_NOTE_BYTES,
    SharedTier,
    key_hex,
    namespace_hex,
    split_options,
)
from kvtier.tiers.skips import Skips

log = logging.getLogger(__name__)
BAD_NAMESPACE = "namespace members that are not 64 hex digits"
BAD_MEMBER = "index members that are not 64-hex keys"
BAD_BUCKET = "index members in another key's bucket"
BAD_SIZE = "sizes that are not positive integers up to the capacity"
SCANNED = (BAD_NAMESPACE, BAD_MEMBER, BAD_BUCKET, BAD_SIZE)
"""What a complete :meth:`RedisTier.scan` meets every entry of."""
NAMESPACE_REFRESH_S = 60.0
REGISTER_RETRY_S = 1.0
Page = list[tuple[bytes, float]]
"""ZSCAN entries of an index bucket: (member, score)."""


class RedisTier(SharedTier):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        own, self.sharing = split_options(config.options, where)
        self.options = parse_options(own, where)
        self.endpoint = self.options.endpoint
        password = load_password(self.options, where)
        self.nodes = make_nodes(self.options, password)
        self.calls = Calls(name, self.options, password, self.nodes.failed)
        self.layout = Layout(self.options.key_prefix)
        self.skips = Skips(name)
        """Entries of the index other writers left that do not parse, by kind."""
        self.routes = Routes(self.nodes, self.calls, self.skips)
        self.notes = Notes(name, self.routes, self.layout, self.skips)
        ttl = self.options.chunk_ttl_s
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        self._registered: dict[str, float] = {}
        """Namespace -> when this tier last added it to the namespace set (monotonic)."""
        self._unregistered: set[str] = set()
        """Namespaces whose last adding failed (logged once until one succeeds)."""
        self.facts = self._read_facts()

    @property
    def skipped_entries(self) -> int:
        """Entries listings and reads passed over since start (``skips.counts`` by kind)."""
        return self.skips.total()

    def _read_facts(self) -> EvictionFacts:
        try:
            facts = self.calls.run("reading maxmemory", lambda: combine(
                [read_facts(c) for c in self.nodes.primaries()]))
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

    def backend_scope(self) -> str:
        """Where this tier keeps its keys, the same on every node: ``redis:<db>/<key_prefix>``
        on one server, ``redis-cluster:<key_prefix>`` on a Redis Cluster (database 0 only).
        No host or port: a server reaches Redis by whatever address it has (a service name,
        an IP, a cluster node of its own choosing), so an address would differ between the
        servers of one tier; two tiers on different servers or clusters with the same prefix
        need ``tier_id`` to tell their notes apart."""
        if self.options.cluster:
            return f"redis-cluster:{self.options.key_prefix}"
        return f"redis:{self.endpoint.db}/{self.options.key_prefix}"

    # ------------------------------------------------------------------ chunks

    def footprint(self, nbytes: int) -> int:
        return footprint(nbytes)

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        header = codec.ChunkHeader.unpack(view[: codec.USED_HEADER_BYTES])
        ns, hexkey = namespace_hex(header.namespace_fp), key_hex(key)
        self._register(ns)
        name, bucket = self.layout.chunk(ns, hexkey), bucket_of(hexkey)
        expiry = () if self._ttl_ms is None else (b"PX", self._ttl_ms)
        stored = footprint(len(view))
        index, sizes = self.layout.index(ns, bucket), self.layout.sizes(ns, bucket)
        self.routes.exec_typed(name, f"writing {hexkey[:16]}", [
            (b"SET", name, view, *expiry),
            (b"ZADD", index, time.time(), hexkey),
            (b"HSET", sizes, hexkey, stored)], {index: "zset", sizes: "hash"})
        return stored

    def _register(self, ns: str) -> None:
        """Add ``ns`` to the namespace set before a write into it, again once a while. The
        set lives on a slot of its own: while its node is down the write goes on (listings
        miss the namespace until it is added), and the set is tried again a second later. A
        value of another type under its name is replaced (:mod:`~kvtier.tiers.redis_repair`)."""
        now = time.monotonic()
        if now - self._registered.get(ns, -NAMESPACE_REFRESH_S) < NAMESPACE_REFRESH_S:
            return
        try:
            self._add_namespace(ns, "adding a namespace")
        except TierIOError as exc:
            if ns not in self._unregistered:
                log.warning("%s (chunks are written; the namespace is listed once it is added)",
                            exc)
            self._unregistered.add(ns)
            self._registered[ns] = now - NAMESPACE_REFRESH_S + REGISTER_RETRY_S
            return
        if ns in self._unregistered:
            self._unregistered.discard(ns)
            log.info("redis tier %s: namespace %s added to the namespace set", self.name,
                     ns[:16])
        self._registered[ns] = now

    def _add_namespace(self, ns: str, what: str) -> None:
        names = self.layout.namespaces
        self.routes.exec_typed(names, what, [(b"SADD", names, ns)], {names: "set"})

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        hexkey = key_hex(key)
        name = self.layout.chunk(namespace_hex(namespace), hexkey)
        out = memoryview(dst).cast("B")
        found = self.routes.bounded_get(name, len(out), f"reading {hexkey[:16]}")
        if found is None or found.size == 0:  # an empty value is no chunk either
            return None
        if found.size > len(out):
            raise ChunkTooLarge(f"redis tier {self.name}: chunk {hexkey[:16]} holds "
                                f"{found.size} bytes, more than the {len(out)} expected "
                                "(not read)")
        out[: len(found.data)] = found.data
        return len(found.data)

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        ns, hexkey = namespace_hex(namespace), key_hex(key)
        name, bucket = self.layout.chunk(ns, hexkey), bucket_of(hexkey)
        index, sizes = self.layout.index(ns, bucket), self.layout.sizes(ns, bucket)
        self.routes.exec_typed(name, f"deleting {hexkey[:16]}", [
            (b"DEL", name), (b"ZREM", index, hexkey), (b"HDEL", sizes, hexkey)],
            {index: "zset", sizes: "hash"})

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        self.delete(key, namespace=namespace)  # nothing is kept on a store others read

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        ns, hexkey = namespace_hex(namespace), key_hex(key)
        name, index = self.layout.chunk(ns, hexkey), self.layout.index(ns, bucket_of(hexkey))
        now = time.time()

        def queue(pipe: Any) -> None:
            pipe.zadd(index, {hexkey: now}, xx=True)  # never adds
            if self._ttl_ms is not None:
                pipe.pexpire(name, self._ttl_ms)

        self.routes.batch(name, f"touching {hexkey[:16]}", queue)

    def scan(self) -> Iterator[StoredChunk]:
        before = self.skips.snapshot()
        for namespace in self.namespaces():
            yield from self.scan_namespace(namespace)
        self.skips.settle(before, SCANNED)  # a complete pass: kinds it did not meet are gone

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        """The index's entries (size, score as mtime, priority 35): may include chunks Redis
        evicted since (a read of one is a miss) until :meth:`reconcile` drops them. Members
        that are not keys, or not of their bucket, are skipped; an index of another type
        lists nothing."""
        ns = namespace_hex(namespace)
        seen: dict[str, set[bytes]] = {b: set() for b in BUCKETS}  # ZSCAN may repeat entries
        for group in self._page_groups(ns, "listing chunks"):
            fresh = [(b, self._members(page, b, seen[b])) for b, page in group]
            now = time.time()
            for member, score, size in self._sized(ns, fresh):
                yield StoredChunk(ChunkKey(bytes.fromhex(member.decode())), size,
                                  mtime_of(score, now), 35, namespace)

    def _page_groups(self, ns: str, what: str) -> Iterator[list[tuple[str, Page]]]:
        """The index buckets' ZSCAN pages: first a page of every bucket (pipelined per
        node), then the further pages of the buckets that have more, one at a time."""
        indexes = [self.layout.index(ns, b) for b in BUCKETS]
        firsts = self.routes.each(indexes, what, lambda pipe, k: pipe.zscan(k, 0, count=BATCH))
        group: list[tuple[str, Page]] = []
        more: list[tuple[str, str, int]] = []
        for bucket, index, first in zip(BUCKETS, indexes, firsts, strict=True):
            if is_wrongtype(first):
                self.skips.add("index keys of another type", where=index)
                continue
            if isinstance(first, RedisError):
                raise self.calls.translate(first, what) from first
            cursor, page = first
            group.append((bucket, page))
            if int(cursor):
                more.append((bucket, index, int(cursor)))
        yield group
        for bucket, index, cursor in more:
            for page in self.routes.zscan(index, what, start=cursor):
                yield [(bucket, page)]

    def _members(self, page: Page, bucket: str, seen: set[bytes]) -> Page:
        """The page's entries not seen before whose member is a key of ``bucket``; the others
        are counted as skipped."""
        fresh = [(m, s) for m, s in page if m not in seen]
        seen.update(m for m, _ in page)
        keys = [(m, s) for m, s in fresh if hex_member(m)]
        mine = [(m, s) for m, s in keys if m[:2].decode() == bucket]
        self.skips.add(BAD_MEMBER, len(fresh) - len(keys))
        self.skips.add(BAD_BUCKET, len(keys) - len(mine))
        return mine

    def _sized(self, ns: str, pages: list[tuple[str, Page]]
               ) -> Iterator[tuple[bytes, float, int]]:
        """Each member of ``pages`` (bucket, entries) with its size: the size buckets' HMGETs
        pipelined per node."""
        pages = [(b, page) for b, page in pages if page]
        wheres = [self.layout.sizes(ns, b) for b, _ in pages]
        members = {w: [m for m, _ in page] for w, (_, page) in zip(wheres, pages, strict=True)}
        hashes = self.routes.each(wheres, "listing sizes",
                                  lambda pipe, k: pipe.hmget(k, members[k]))
        for (_, page), where, hashed in zip(pages, wheres, hashes, strict=True):
            yield from self._sized_page(ns, page, where, hashed)

    def _sized_page(self, ns: str, page: Page, where: str, hashed: Any
                    ) -> Iterator[tuple[bytes, float, int]]:
        """A size that is missing (evicted) or not a positive integer (garbage) is asked of
        the chunk itself: 0 means it is gone."""
        members = [m for m, _ in page]
        if is_wrongtype(hashed):
            self.skips.add("size hashes of another type", where=where)
            hashed = [None] * len(members)
        elif isinstance(hashed, RedisError):
            raise self.calls.translate(hashed, "listing sizes") from hashed
        sizes = [size_of(v, self.config.capacity_bytes) for v in hashed]
        self.skips.add(BAD_SIZE,
                       sum(1 for v, n in zip(hashed, sizes, strict=True) if v is not None
                           and not n))
        lost = [m for m, size in zip(members, sizes, strict=True) if size is None]
        lengths: dict[bytes, int] = {}
        if lost:  # the size hash was evicted: ask the chunks (0 for one that is gone too)
            found = self.routes.batch(where, "reading lost sizes", lambda pipe: [
                pipe.strlen(self.layout.chunk(ns, m.decode())) for m in lost],
                raise_on_error=False)
            lengths = {m: n if isinstance(n, int) else 0 for m, n in zip(lost, found,
                                                                        strict=True)}
        for (member, score), size in zip(page, sizes, strict=True):
            if size is not None:
                yield member, float(score), size
            elif lengths[member]:
                yield member, float(score), footprint(lengths[member])

    def namespaces(self) -> list[bytes]:
        return [bytes.fromhex(ns) for ns in self._indexed_namespaces() if self._count(ns)]

    def _count(self, ns: str) -> int:
        """Index entries of ``ns`` over its buckets (those of another type count none)."""
        indexes = [self.layout.index(ns, b) for b in BUCKETS]
        counts = self.routes.each(indexes, "counting chunks", lambda pipe, k: pipe.zcard(k))
        for index, n in zip(indexes, counts, strict=True):
            if is_wrongtype(n):
                self.skips.add("index keys of another type", where=index)
            elif isinstance(n, RedisError):
                raise self.calls.translate(n, "counting chunks") from n
        return sum(n for n in counts if isinstance(n, int))

    def _indexed_namespaces(self) -> list[str]:
        """The namespace set's members that are namespaces (64 hex digits); the rest are
        skipped and counted, and a key of another type under its name lists none."""
        names = self.layout.namespaces

        def members(client: redis.Redis) -> set[bytes]:
            try:
                return cast(set[bytes], client.smembers(names))
            except ResponseError as exc:
                if not is_wrongtype(exc):
                    raise
                self.skips.add("namespace sets of another type", where=names)
                return set()
        found = self.routes.at(names, "listing namespaces", members)
        listed = sorted(ns for ns in map(hex_member, found) if ns is not None)
        self.skips.add(BAD_NAMESPACE, len(found) - len(listed))
        return listed

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        self.notes.put(name, data)

    def get_note(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        return self.notes.get(name, max_bytes)

    def list_notes(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        return self.notes.names(prefix, start_after, limit)

    def delete_note(self, name: str) -> None:
        self.notes.delete(name)

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
            for group in self._page_groups(ns, "reconciling the index"):
                dropped += self._drop_gone(ns, group)
            self._forget_if_empty(ns)
        return dropped + self.notes.reconcile()

    def _drop_gone(self, ns: str, group: list[tuple[str, Page]]) -> int:
        """Drop the entries of ``group`` whose chunk is gone: EXISTS pipelined per node,
        :data:`BATCH` x 8 at a time, then one WATCHed transaction per bucket that lost any."""
        entries = [(b, m, self.layout.chunk(ns, m.decode())) for b, page in group
                   for m, _ in page if hex_member(m) and m[:2].decode() == b]
        dropped = 0
        step = BATCH * 8
        for at in range(0, len(entries), step):
            batch = entries[at:at + step]
            there = self.routes.each([name for _, _, name in batch], "checking indexed keys",
                                     lambda pipe, k: pipe.exists(k))
            gone: dict[str, dict[bytes, str]] = {}
            for (bucket, member, name), n in zip(batch, there, strict=True):
                if isinstance(n, RedisError):
                    raise self.calls.translate(n, "checking indexed keys") from n
                if not n:
                    gone.setdefault(bucket, {})[member] = name
            for bucket, lost in gone.items():
                dropped += self._drop_if_gone(ns, bucket, lost)
        return dropped

    def _drop_if_gone(self, ns: str, bucket: str, lost: dict[bytes, str]) -> int:
        index, sizes = self.layout.index(ns, bucket), self.layout.sizes(ns, bucket)
        return self.routes.at(index, "dropping vanished index entries",
                              lambda client: drop_if_gone(client, index, sizes, lost))

    def _forget_if_empty(self, ns: str) -> None:
        """Remove ``ns`` from the namespace set if none of its buckets holds an entry; put it
        back if a writer filled one meanwhile (the buckets are on other slots: no WATCH)."""
        if self._count(ns):
            return
        names = self.layout.namespaces
        self.routes.at(names, "forgetting an empty namespace", lambda c: c.srem(names, ns))
        self._registered.pop(ns, None)
        if self._count(ns):
            self._add_namespace(ns, "keeping a namespace")

    def describe(self) -> dict[str, Any]:
        source = ("password_env" if self.options.password_env else
                  "password_file" if self.options.password_file else
                  "url" if self.endpoint.password is not None else None)
        return {**super().describe(), "url": self.endpoint.redacted(), "shared": True,
                "cluster": self.options.cluster,
                "key_prefix": self.options.key_prefix, "tls": self.endpoint.tls,
                "verify": self.options.verify, "password_source": source,
                "max_connections": self.options.max_connections,
                "chunk_ttl_s": self.options.chunk_ttl_s,
                "maxmemory": self.facts.maxmemory, "maxmemory_policy": self.facts.policy}

    def close(self) -> None:
        self.nodes.close()
