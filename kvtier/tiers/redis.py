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
listing sees both or neither. A read (STRLEN + GETRANGE up to the reader's buffer, one round
trip) refreshes Redis's own LRU clock and never transfers a value larger than the buffer or a
note's cap; ``touch`` moves the index score (and the TTL with ``chunk_ttl_s``). Redis may
evict or expire chunks itself (docs/shared.md): the index then names chunks that are gone. A
read of one is a miss, the listing may still report it until :meth:`RedisTier.reconcile` (run
by the sweeper through ``clean_stale_temps``) drops such entries in batches. An evicted index
or note structure loses listings, never bytes: nothing here trusts the index for what a read
returns. Other programs may write under the prefix too: index entries that do not parse are
skipped and counted (:mod:`~kvtier.tiers.redis_index`), never fail a listing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from redis.exceptions import RedisError, ResponseError

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import ChunkTooLarge, NoteTooLarge, TierIOError
from kvtier.keys import ChunkKey
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.redis_client import Calls, make_client
from kvtier.tiers.redis_index import (
    hex_member,
    is_wrongtype,
    mtime_of,
    note_member,
    size_of,
)
from kvtier.tiers.redis_memory import (
    UNKNOWN,
    EvictionFacts,
    eviction_warning,
    footprint,
    read_facts,
)
from kvtier.tiers.redis_options import load_password, parse_options
from kvtier.tiers.redis_repair import run_typed
from kvtier.tiers.redis_upkeep import drop_if_gone, forget_if_empty
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
BAD_NAMESPACE = "namespace members that are not 64 hex digits"
BAD_MEMBER = "index members that are not 64-hex keys"
BAD_SIZE = "sizes that are not positive integers up to the capacity"
SCANNED = (BAD_NAMESPACE, BAD_MEMBER, BAD_SIZE)
"""What a complete :meth:`RedisTier.scan` meets every entry of."""
BATCH = 512
"""Index entries per ZSCAN page, HMGET and EXISTS round trip."""


class Bounded(NamedTuple):
    """A value read no further than a limit: its whole length, and its first bytes."""

    size: int
    data: bytes


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
        self.skips = Skips(name)
        """Entries of the index other writers left that do not parse, by kind."""
        ttl = self.options.chunk_ttl_s
        self._ttl_ms = None if ttl is None else int(ttl * 1000)
        self.facts = self._read_facts()

    @property
    def skipped_entries(self) -> int:
        """Entries listings and reads passed over since start (``skips.counts`` by kind)."""
        return self.skips.total()

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

    def _batch(self, what: str, queue: Callable[[Any], object], *,
               raise_on_error: bool = True) -> list[Any]:
        """``queue(pipe)`` adds commands; they run pipelined, not atomically. Without
        ``raise_on_error`` a refused command's error is its reply (a wrong type)."""
        def call() -> list[Any]:
            with self.client.pipeline(transaction=False) as pipe:
                queue(pipe)
                return pipe.execute(raise_on_error=raise_on_error)
        return cast(list[Any], self._run(what, call))

    def backend_scope(self) -> str:
        return f"redis:{self.endpoint.db}/{self.options.key_prefix}"

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
        typed = {self.layout.index(ns): "zset", self.layout.sizes(ns): "hash",
                 self.layout.namespaces: "set"}
        self._typed(f"writing {hexkey[:16]}", commands, typed)
        return stored

    def _typed(self, what: str, commands: list[tuple[Arg, ...]], typed: dict[str, str]
               ) -> None:
        """``commands`` in one MULTI/EXEC, the index keys ``typed`` put back to their types
        if another writer put another type there (:mod:`kvtier.tiers.redis_repair`)."""
        pool = self.client.connection_pool
        self._run(what, lambda: run_typed(pool, commands, typed, self.skips))

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
        commands: list[tuple[bytes | str | int, ...]] = [(b"STRLEN", name)]
        if limit > 0:  # GETRANGE 0 -1 would be the whole value
            commands.append((b"GETRANGE", name, 0, limit - 1))
        if exists:
            commands.append((b"EXISTS", name))
        pool = self.client.connection_pool
        replies = self._run(what, lambda: transaction(pool, commands, raise_errors=False))
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
        index, sizes = self.layout.index(ns), self.layout.sizes(ns)
        self._typed(f"deleting {hexkey[:16]}",
                    [(b"DEL", self.layout.chunk(ns, hexkey)), (b"ZREM", index, hexkey),
                     (b"HDEL", sizes, hexkey)], {index: "zset", sizes: "hash"})

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
        before = self.skips.snapshot()
        for namespace in self.namespaces():
            yield from self.scan_namespace(namespace)
        self.skips.settle(before, SCANNED)  # a complete pass: kinds it did not meet are gone

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        """The index's entries (size, score as mtime, priority 35): may include chunks Redis
        evicted since (a read of one is a miss) until :meth:`reconcile` drops them. Members
        that are not keys are skipped; an index of another type lists nothing."""
        ns = namespace_hex(namespace)
        seen: set[bytes] = set()  # ZSCAN may return an entry twice while Redis rehashes
        bad = 0
        for page in self._zscan(self.layout.index(ns), "listing chunks"):
            fresh = [(m, s) for m, s in page if m not in seen and hex_member(m)]
            bad += sum(1 for m, _ in page if m not in seen and not hex_member(m))
            seen.update(m for m, _ in page)
            now = time.time()
            for member, score, size in self._sized(ns, fresh):
                yield StoredChunk(ChunkKey(bytes.fromhex(member.decode())), size,
                                  mtime_of(score, now), 35, namespace)
        self.skips.add(BAD_MEMBER, bad)

    def _zscan(self, index: str, what: str) -> Iterator[list[tuple[bytes, float]]]:
        """ZSCAN pages; a key of another type under ``index`` has none (skipped, counted)."""
        cursor = 0
        while True:
            def step(at: int = cursor) -> tuple[int, list[tuple[bytes, float]]]:
                try:
                    return cast(tuple[int, list[tuple[bytes, float]]],
                                self.client.zscan(index, at, count=BATCH))
                except ResponseError as exc:
                    if not is_wrongtype(exc):
                        raise
                    self.skips.add("index keys of another type", where=index)
                    return 0, []
            cursor, page = self._run(what, step)
            yield page
            if cursor == 0:
                return

    def _sized(self, ns: str, page: list[tuple[bytes, float]]
               ) -> Iterator[tuple[bytes, float, int]]:
        """Each member with its size from the size hash; a size that is missing (evicted) or
        not a positive integer (garbage) is asked of the chunk itself: 0 means it is gone."""
        if not page:
            return
        members = [m for m, _ in page]
        hashed = self._batch("listing sizes", lambda pipe: pipe.hmget(
            self.layout.sizes(ns), members), raise_on_error=False)[0]
        if is_wrongtype(hashed):
            self.skips.add("size hashes of another type", where=self.layout.sizes(ns))
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
            found = self._batch("reading lost sizes", lambda pipe: [
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
        listed = self._indexed_namespaces()
        counts = self._batch("counting chunks", lambda pipe: [
            pipe.zcard(self.layout.index(ns)) for ns in listed], raise_on_error=False)
        wrong = [ns for ns, n in zip(listed, counts, strict=True) if is_wrongtype(n)]
        for ns in wrong:
            self.skips.add("index keys of another type", where=self.layout.index(ns))
        return [bytes.fromhex(ns) for ns, n in zip(listed, counts, strict=True)
                if isinstance(n, int) and n]

    def _indexed_namespaces(self) -> list[str]:
        """The namespace set's members that are namespaces (64 hex digits); the rest are
        skipped and counted, and a key of another type under its name lists none."""
        def members() -> set[bytes]:
            try:
                return cast(set[bytes], self.client.smembers(self.layout.namespaces))
            except ResponseError as exc:
                if not is_wrongtype(exc):
                    raise
                self.skips.add("namespace sets of another type", where=self.layout.namespaces)
                return set()
        found = self._run("listing namespaces", members)
        listed = sorted(ns for ns in map(hex_member, found) if ns is not None)
        self.skips.add(BAD_NAMESPACE,
                       len(found) - len(listed))
        return listed

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        check_note_name(name)
        self._typed(f"writing note {name}", [(b"SET", self.layout.note(name), data),
                                             (b"ZADD", self.layout.notes, 0, name)],
                    {self.layout.notes: "zset"})

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
        def call() -> list[bytes]:
            try:
                return cast(list[bytes], self.client.zrangebylex(
                    self.layout.notes, low, high, start=0, num=count))
            except ResponseError as exc:
                if not is_wrongtype(exc):
                    raise
                self.skips.add("index keys of another type", where=self.layout.notes)
                return []
        return cast(list[bytes], self._run(what, call))

    def delete_note(self, name: str) -> None:
        check_note_name(name)
        self._typed(f"deleting note {name}", [(b"DEL", self.layout.note(name)),
                                              (b"ZREM", self.layout.notes, name)],
                    {self.layout.notes: "zset"})

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
                keys = {m: self.layout.chunk(ns, k) for m, k in
                        ((m, hex_member(m)) for m, _ in page) if k is not None}
                dropped += self._drop_vanished(index, self.layout.sizes(ns), keys)
            self._forget_if_empty(ns)
        for page in self._zscan(self.layout.notes, "reconciling notes"):
            notes = {m: self.layout.note(n) for m, n in
                     ((m, note_member(m)) for m, _ in page) if n is not None}
            dropped += self._drop_vanished(self.layout.notes, None, notes)
        return dropped

    def _drop_vanished(self, index: str, sizes: str | None, keys: dict[bytes, str]) -> int:
        if not keys:
            return 0
        there = self._batch("checking indexed keys", lambda pipe: [
            pipe.exists(k) for k in keys.values()])
        gone = {m: k for (m, k), n in zip(keys.items(), there, strict=True) if not n}
        if not gone:
            return 0

        return cast(int, self._run("dropping vanished index entries", lambda: drop_if_gone(
            self.client, index, sizes, gone)))

    def _forget_if_empty(self, ns: str) -> None:
        self._run("forgetting an empty namespace", lambda: forget_if_empty(
            self.client, self.layout.index(ns), self.layout.sizes(ns), self.layout.namespaces,
            ns))

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
