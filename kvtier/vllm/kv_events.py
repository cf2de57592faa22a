"""kvtier's tiers in vLLM's own KV-event stream.

With ``kv_events_config`` enabled, vLLM's scheduler publishes the device prefix cache's
``BlockStored`` / ``BlockRemoved`` events (medium ``GPU``) on its ZMQ publisher, and appends
whatever its connector's ``take_events()`` yields. Routers that follow those streams
(vllm-router's ``kv_aware``, llm-d, Dynamo) then see kvtier's tiers without knowing kvtier:

=================  ===========  ==========  ==============================================
kvtier tier        ``medium``   locality    ``ownership``
=================  ===========  ==========  ==============================================
arena (host RAM)   ``CPU``      ``LOCAL``   none (the primary offloading tier)
disk               ``STORAGE``  ``LOCAL``   the tier's name, e.g. ``disk``
shared (fs, s3..)  ``STORAGE``  ``REMOTE``  the tier's name, e.g. ``shared``
=================  ===========  ==========  ==============================================

Each stored chunk is one ``BlockStored`` with vLLM's own hashes of the chunk's blocks (a
256-token chunk is 2 blocks on CPU), the hash of the block before it, its tokens and vLLM's
block size, exactly as vLLM's OffloadingConnector describes its chunks; removals fan out to
the same hashes. The node server keeps a bounded log of what each tier stored and removed
(:class:`~kvtier.protocol.Events`); :class:`KvEventFeed` reads it at most once per engine
step, when due (every ``interval_s``, or at once after this engine stored or leased chunks),
and translates keys with the :class:`~kvtier.vllm.block_book.BlockBook` the scheduler side
fills.

Resynchronising: when the log dropped events this feed had not read (``lost``), or the server
restarted (a new instance), every block this feed announced is taken back with
``BlockRemoved`` and the log is read again from its start, which announces again what is
still held. vLLM's ``AllBlocksCleared`` is not used: it would also clear the device cache's
blocks in the consumers' view.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvtier.keys import ChunkKey
from kvtier.protocol import Events, Stats
from kvtier.vllm.block_book import BlockBook, ChunkBlocks
from kvtier.vllm.link import ServerLink

log = logging.getLogger("kvtier.vllm")
ARENA = "arena"
PAGE = 4096
MAX_PAGES = 8
"""Log pages read per poll at most (the rest waits for the next step)."""


class LoraLike(Protocol):
    @property
    def adapter_id(self) -> int: ...
    @property
    def name(self) -> str: ...


class RequestLike(Protocol):
    """The part of vLLM's ``Request`` the feed reads."""

    @property
    def request_id(self) -> str: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def lora_request(self) -> LoraLike | None: ...


class KvEventFeed:
    def __init__(self, link: ServerLink, namespace_fp: bytes, block_size: int,
                 chunk_tokens: int, *, interval_s: float = 0.5, capacity: int = 16384,
                 spec_kind: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link = link
        self.namespace_fp = namespace_fp
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.interval_s = interval_s
        self.spec_kind = spec_kind
        self.clock = clock
        self.book = BlockBook(capacity)
        self.untranslated = 0
        """Server events about chunks this feed never saw (another engine's, or forgotten)."""
        self._requests: dict[str, RequestLike] = {}
        self._since = 0
        self._server: str | None = None
        self._shared: set[str] = set()
        self._polled_at = -float("inf")
        self._dirty = False
        self._backlog: list[KVCacheEvent] = []

    # ------------------------------------------------------------------ what chunks hold

    def track(self, request: RequestLike) -> None:
        self._requests[request.request_id] = request

    def untrack(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def chunks_seen(self, req_id: str, start_chunk: int, keys: Sequence[ChunkKey]) -> None:
        """The scheduler side stores or loads ``keys``, chunks ``start_chunk``... of the
        request: write down their blocks while the request has them."""
        request = self._requests.get(req_id)
        if request is None:
            return
        for i, key in enumerate(keys):
            blocks = self._blocks_of(request, start_chunk + i)
            if blocks is not None:
                self.book.write(key, blocks)
        self._dirty = True

    def _blocks_of(self, request: RequestLike, chunk: int) -> ChunkBlocks | None:
        bpc = self.blocks_per_chunk
        first = chunk * bpc
        hashes = tuple(request.block_hashes[first:first + bpc])
        if len(hashes) < bpc or any(h is None for h in hashes):
            return None  # vLLM has not hashed these blocks (prefix caching off)
        parent = request.block_hashes[first - 1] if first else None
        start = chunk * self.chunk_tokens
        tokens = array("l", request.all_token_ids[start:start + self.chunk_tokens])
        lora = request.lora_request
        return ChunkBlocks(hashes, parent, tokens, self.block_size,
                           lora.adapter_id if lora is not None else None,
                           lora.name if lora is not None else None)

    def renamespace(self, namespace_fp: bytes) -> None:
        """The engine moved to a new namespace: what it announced no longer matches (taken
        back with the next :meth:`take`)."""
        self._backlog += self._take_back_all()
        self.book.clear()
        self.namespace_fp = namespace_fp
        self._dirty = True

    # ------------------------------------------------------------------ events out

    def take(self) -> list[KVCacheEvent]:
        """vLLM events for what the server stored and removed since the last call (empty
        unless a poll is due; at most one round trip per call when the log is quiet)."""
        now = self.clock()
        if not self._dirty and now - self._polled_at < self.interval_s:
            return []
        self._polled_at, self._dirty = now, False
        out, self._backlog = self._backlog, []
        for _ in range(MAX_PAGES):
            if not self._follow_server(out):
                break
            reply = self.link.call(Events(self._since, self.namespace_fp, PAGE), None)
            if reply is None:
                break
            if self.link.arena_name() != self._server:
                continue  # the server restarted under the call: that was the new one's log
            if reply.lost and self._since > 0:
                log.info("kvtier KV events: the server's log dropped events; resynchronising")
                out += self._take_back_all()
                self._since = 0
                continue
            self._since = reply.next
            out += self._translate(reply.events)
            if len(reply.events) < PAGE:
                break
        return out

    def _follow_server(self, out: list[KVCacheEvent]) -> bool:
        """False if the server cannot be reached; a new server instance (restarted) gets
        everything taken back and its log read from the start."""
        server = self.link.arena_name()
        if server is None:
            return False
        if server != self._server:
            if self._server is not None:
                log.info("kvtier server restarted: resynchronising its KV events")
                out += self._take_back_all()
            self._server, self._since = server, 0
            self._shared = self._shared_tiers()
        return True

    def _translate(self, events: Iterable[tuple[int, str, str, bytes]]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        run: list[Any] = []
        run_tier = ""
        for _seq, op, tier, raw in events:
            blocks = self.book.get(ChunkKey(raw))
            if blocks is None:
                self.untranslated += 1
                continue
            if op == "stored":
                if run:
                    out.append(self._removed(run, run_tier))
                    run = []
                blocks.held.add(tier)
                out.append(self._stored(blocks, tier))
                continue
            blocks.held.discard(tier)
            if run and tier != run_tier:
                out.append(self._removed(run, run_tier))
                run = []
            run_tier = tier
            run += [maybe_convert_block_hash(h) for h in blocks.hashes]  # type: ignore[arg-type]
        if run:
            out.append(self._removed(run, run_tier))
        return out

    def _take_back_all(self) -> list[KVCacheEvent]:
        by_tier: dict[str, list[Any]] = {}
        for _key, blocks in self.book.held():
            for tier in blocks.held:
                by_tier.setdefault(tier, []).extend(
                    maybe_convert_block_hash(h) for h in blocks.hashes)  # type: ignore[arg-type]
            blocks.held.clear()
        return [self._removed(hashes, tier) for tier, hashes in by_tier.items()]

    # ------------------------------------------------------------------ vLLM's shapes

    def _stored(self, blocks: ChunkBlocks, tier: str) -> BlockStored:
        medium, locality, ownership = self._where(tier)
        parent = blocks.parent
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in blocks.hashes],  # type: ignore[arg-type]
            parent_block_hash=(maybe_convert_block_hash(parent)  # type: ignore[arg-type]
                               if parent is not None else None),
            token_ids=blocks.tokens.tolist(), block_size=blocks.block_size,
            lora_id=blocks.lora_id, medium=medium, lora_name=blocks.lora_name,
            group_idx=0, kv_cache_spec_kind=self.spec_kind, locality=locality,
            ownership=ownership)

    def _removed(self, hashes: list[Any], tier: str) -> BlockRemoved:
        medium, locality, ownership = self._where(tier)
        return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=0,
                            locality=locality, ownership=ownership)

    def _where(self, tier: str) -> tuple[str, str, str | None]:
        if tier == ARENA:
            return MEDIUM_CPU, "LOCAL", None
        return MEDIUM_STORAGE, "REMOTE" if tier in self._shared else "LOCAL", tier

    def _shared_tiers(self) -> set[str]:
        reply = self.link.call(Stats(), None)
        tiers = reply.stats.get("tiers", {}) if reply is not None else {}
        if not isinstance(tiers, dict):
            return set()
        return {name for name, doc in tiers.items()
                if isinstance(doc, dict) and doc.get("shared")}
