"""The ``redis`` tier: chunks as values on a Redis or Valkey server, or a Redis Cluster, that
every node reaches. Key names: :mod:`~kvtier.tiers.redis_layout`; which node serves a key:
:mod:`~kvtier.tiers.redis_nodes`.

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
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar, cast

import redis
from redis.exceptions import AskError, MovedError, RedisError, ResponseError

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import ChunkTooLarge, NoteTooLarge, TierIOError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.redis_client import Calls, make_nodes
from kvtier.tiers.redis_index import (
    hex_member,
    is_wrongtype,
    mtime_of,
    note_member,
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
from kvtier.tiers.redis_options import load_password, parse_options
from kvtier.tiers.redis_upkeep import drop_if_gone
from kvtier.tiers.redis_wire import Arg, transaction
from kvtier.tiers.shared import (
    MAX_LISTED_NOTES,
    MAX_NOTE_BYTES,
    SharedTier,
    check_note_name,
    key_hex,
    namespace_hex,
    split_options,
)
from kvtier.tiers.skips import Skips

log = logging.getLogger(__name__)
T = TypeVar("T")
BAD_NAMESPACE = "namespace members that are not 64 hex digits"
BAD_MEMBER = "index members that are not 64-hex keys"
BAD_BUCKET = "index members in another key's bucket"
BAD_SIZE = "sizes that are not positive integers up to the capacity"
SCANNED = (BAD_NAMESPACE, BAD_MEMBER, BAD_BUCKET, BAD_SIZE)
"""What a complete :meth:`RedisTier.scan` meets every entry of."""
BATCH = 512
"""Index entries per ZSCAN page, HMGET and EXISTS round trip."""
MAX_REDIRECTS = 3
"""MOVED / ASK replies followed for one call before it fails (a slot moving back and forth)."""
NAMESPACE_REFRESH_S = 60.0


class Bounded(NamedTuple):
    """A value read no further than a limit: its whole length, and its first bytes."""

    size: int
    data: bytes


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
        ttl = self.options.chunk_ttl_s
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        self._registered: dict[str, float] = {}
        """Namespace -> when this tier last added it to the namespace set (monotonic)."""
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

    # ------------------------------------------------------------------ calls

    def _at(self, key: str, what: str, call: Callable[[redis.Redis], T], *,
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

    def _exec(self, key: str, what: str, commands: list[tuple[Arg, ...]], *,
              raise_errors: bool = True) -> list[Any]:
        """``commands`` (all on ``key``'s slot) in one MULTI/EXEC round trip."""
        return self._at(key, what, lambda c: transaction(
            c.connection_pool, commands, raise_errors=raise_errors), asking=lambda c: transaction(
            c.connection_pool, commands, raise_errors=raise_errors, asking=True))

    def _batch(self, key: str, what: str, queue: Callable[[Any], object], *,
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
        return self._at(key, what, call)

    def _each(self, keys: list[str], what: str, command: Callable[[Any, str], object]
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
            got = self._batch(keys[group[0]], what, queue, raise_on_error=False)
            for i, reply in zip(group, got, strict=True):
                replies[i] = reply
        return replies

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
        self._exec(name, f"writing {hexkey[:16]}", [
            (b"SET", name, view, *expiry),
            (b"ZADD", self.layout.index(ns, bucket), time.time(), hexkey),
            (b"HSET", self.layout.sizes(ns, bucket), hexkey, stored)])
        return stored

    def _register(self, ns: str) -> None:
        """Add ``ns`` to the namespace set before a write into it, again once a while."""
        now = time.monotonic()
        if now - self._registered.get(ns, -NAMESPACE_REFRESH_S) < NAMESPACE_REFRESH_S:
            return
        names = self.layout.namespaces
        self._at(names, "adding a namespace", lambda c: c.sadd(names, ns))
        self._registered[ns] = now

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        hexkey = key_hex(key)
        name = self.layout.chunk(namespace_hex(namespace), hexkey)
        out = memoryview(dst).cast("B")
        found = self._bounded_get(name, len(out), f"reading {hexkey[:16]}")
        if found is None or found.size == 0:  # an empty value is no chunk either
            return None
        if found.size > len(out):
            raise ChunkTooLarge(f"redis tier {self.name}: chunk {hexkey[:16]} holds "
                                f"{found.size} bytes, more than the {len(out)} expected "
                                "(not read)")
        out[: len(found.data)] = found.data
        return len(found.data)

    def _bounded_get(self, name: str, limit: int, what: str, *,
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
        replies = self._exec(name, what, commands, raise_errors=False)
        for reply in replies:
            if is_wrongtype(reply):
                self.skips.add("values of another type", where=name)
                return None
            if isinstance(reply, RedisError):
                raise self.calls.translate(reply, what) from reply
        if exists and not replies[-1]:
            return None
        return Bounded(int(replies[0]), bytes(replies[1]) if limit > 0 else b"")

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        ns, hexkey = namespace_hex(namespace), key_hex(key)
        name, bucket = self.layout.chunk(ns, hexkey), bucket_of(hexkey)
        self._exec(name, f"deleting {hexkey[:16]}", [
            (b"DEL", name), (b"ZREM", self.layout.index(ns, bucket), hexkey),
            (b"HDEL", self.layout.sizes(ns, bucket), hexkey)])

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

        self._batch(name, f"touching {hexkey[:16]}", queue)

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
        for bucket in BUCKETS:
            seen: set[bytes] = set()  # ZSCAN may return an entry twice while Redis rehashes
            for page in self._zscan(self.layout.index(ns, bucket), "listing chunks"):
                fresh = self._members(page, bucket, seen)
                now = time.time()
                for member, score, size in self._sized(ns, bucket, fresh):
                    yield StoredChunk(ChunkKey(bytes.fromhex(member.decode())), size,
                                      mtime_of(score, now), 35, namespace)

    def _members(self, page: list[tuple[bytes, float]], bucket: str, seen: set[bytes]
                 ) -> list[tuple[bytes, float]]:
        """The page's entries not seen before whose member is a key of ``bucket``; the others
        are counted as skipped."""
        fresh = [(m, s) for m, s in page if m not in seen]
        seen.update(m for m, _ in page)
        keys = [(m, s) for m, s in fresh if hex_member(m)]
        mine = [(m, s) for m, s in keys if m[:2].decode() == bucket]
        self.skips.add(BAD_MEMBER, len(fresh) - len(keys))
        self.skips.add(BAD_BUCKET, len(keys) - len(mine))
        return mine

    def _zscan(self, index: str, what: str) -> Iterator[list[tuple[bytes, float]]]:
        """ZSCAN pages; a key of another type under ``index`` has none (skipped, counted)."""
        cursor = 0
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
            cursor, page = self._at(index, what, step)
            yield page
            if cursor == 0:
                return

    def _sized(self, ns: str, bucket: str, page: list[tuple[bytes, float]]
               ) -> Iterator[tuple[bytes, float, int]]:
        """Each member with its size from the size hash; a size that is missing (evicted) or
        not a positive integer (garbage) is asked of the chunk itself: 0 means it is gone."""
        if not page:
            return
        members = [m for m, _ in page]
        where = self.layout.sizes(ns, bucket)
        hashed = self._batch(where, "listing sizes", lambda pipe: pipe.hmget(where, members),
                             raise_on_error=False)[0]
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
            found = self._batch(where, "reading lost sizes", lambda pipe: [
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
        counts = self._each(indexes, "counting chunks", lambda pipe, k: pipe.zcard(k))
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
        found = self._at(names, "listing namespaces", members)
        listed = sorted(ns for ns in map(hex_member, found) if ns is not None)
        self.skips.add(BAD_NAMESPACE, len(found) - len(listed))
        return listed

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        key = self.layout.note(check_note_name(name))
        self._exec(key, f"writing note {name}", [
            (b"SET", key, data), (b"ZADD", self.layout.notes, 0, name)])

    def get_note(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        key = self.layout.note(check_note_name(name))
        found = self._bounded_get(key, max_bytes, f"reading note {name}", exists=True)
        if found is None:
            return None
        if found.size > max_bytes:
            raise NoteTooLarge(f"redis tier {self.name}: note {name} holds {found.size} bytes, "
                               f"more than the {max_bytes} a note may (not read)")
        return found.data

    def list_notes(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        """The first ``limit`` valid note names under ``prefix`` (at any depth), in order;
        members of the name index that are not note names are skipped and counted."""
        folder = check_note_name(prefix.rstrip("/")) + "/"
        low = b"(" + start_after.encode() if start_after >= folder else b"[" + folder.encode()
        high = f"({folder[:-1]}0"  # '0' follows '/': the end of the folder's range
        names: list[str] = []
        while len(names) < limit:
            want = min(limit - len(names), BATCH * 8)
            page = self._notes_range(f"listing notes {prefix}", low, high, want)
            valid = [n for n in map(note_member, page) if n is not None and n > start_after]
            self.skips.add("note names that are not valid", len(page) - len(valid))
            names += valid
            if len(page) < want:
                break
            low = b"(" + page[-1]
        return names

    def _notes_range(self, what: str, low: bytes, high: str, count: int) -> list[bytes]:
        """Up to ``count`` members of the name index in (low, high); none where another
        type sits under its name."""
        notes = self.layout.notes

        def call(client: redis.Redis) -> list[bytes]:
            try:
                return cast(list[bytes], client.zrangebylex(notes, low, high, start=0,
                                                            num=count))
            except ResponseError as exc:
                if not is_wrongtype(exc):
                    raise
                self.skips.add("index keys of another type", where=notes)
                return []
        return self._at(notes, what, call)

    def delete_note(self, name: str) -> None:
        key = self.layout.note(check_note_name(name))
        self._exec(key, f"deleting note {name}", [
            (b"DEL", key), (b"ZREM", self.layout.notes, name)])

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
            for bucket in BUCKETS:
                index = self.layout.index(ns, bucket)
                for page in self._zscan(index, "reconciling the index"):
                    keys = {m: self.layout.chunk(ns, m.decode()) for m, _ in page
                            if hex_member(m) and m[:2].decode() == bucket}
                    dropped += self._drop_vanished(index, self.layout.sizes(ns, bucket), keys)
            self._forget_if_empty(ns)
        for page in self._zscan(self.layout.notes, "reconciling notes"):
            notes = {m: self.layout.note(n) for m, n in
                     ((m, note_member(m)) for m, _ in page) if n is not None}
            dropped += self._drop_vanished(self.layout.notes, None, notes)
        return dropped

    def _drop_vanished(self, index: str, sizes: str | None, keys: dict[bytes, str]) -> int:
        """``keys`` (member -> value key) all share ``index``'s slot."""
        if not keys:
            return 0
        there = self._batch(index, "checking indexed keys", lambda pipe: [
            pipe.exists(k) for k in keys.values()])
        gone = {m: k for (m, k), n in zip(keys.items(), there, strict=True) if not n}
        if not gone:
            return 0
        return self._at(index, "dropping vanished index entries",
                        lambda client: drop_if_gone(client, index, sizes, gone))

    def _forget_if_empty(self, ns: str) -> None:
        """Remove ``ns`` from the namespace set if none of its buckets holds an entry; put it
        back if a writer filled one meanwhile (the buckets are on other slots: no WATCH)."""
        if self._count(ns):
            return
        names = self.layout.namespaces
        self._at(names, "forgetting an empty namespace", lambda c: c.srem(names, ns))
        self._registered.pop(ns, None)
        if self._count(ns):
            self._at(names, "keeping a namespace", lambda c: c.sadd(names, ns))

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
