"""Turns decoded requests into store calls and replies (one instance per server).

Bad input from a client (a malformed value, an unknown lease) gets an ``Error`` reply that
says what was wrong; it never changes what is already stored. Only a frame that cannot be
decoded at all closes the connection (the stream can no longer be trusted).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from typing import IO

from kvtier import __version__
from kvtier.codec import HEADER_SIZE
from kvtier.entry import ItemState, LeaseRecord
from kvtier.keys import KEY_BYTES, ChunkKey
from kvtier.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Commit,
    CountReply,
    Error,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    LeaseStatus,
    Lookup,
    LookupReply,
    Release,
    Reply,
    Report,
    Request,
    Reserve,
    ReserveReply,
    SetPriority,
    Stats,
    StatsReply,
    Wait,
)
from kvtier.store import TieredStore

log = logging.getLogger("kvtier.server")
_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_WAIT_S = 60.0


def _keys(raw: list[bytes]) -> list[ChunkKey]:
    for item in raw:
        if len(item) != KEY_BYTES:
            raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got one of {len(item)}")
    return [ChunkKey(item) for item in raw]


class Service:
    def __init__(self, store: TieredStore, access_log: str | None = None) -> None:
        self.store = store
        self.instance = secrets.token_hex(8)
        self._log_file: IO[str] | None = None
        self._log_lock = threading.Lock()
        if access_log:
            os.makedirs(os.path.dirname(os.path.abspath(access_log)), exist_ok=True)
            fd = os.open(access_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._log_file = os.fdopen(fd, "a", buffering=1)

    def handle(self, owner: int, request: Request) -> Reply:
        op = type(request).__name__.lower()
        start = time.perf_counter()
        try:
            return self._dispatch(owner, request)
        except (ValueError, KeyError) as exc:
            message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
            return Error("bad_request", message)
        except Exception as exc:  # the server must outlive any one request
            log.exception("request %s failed", op)
            return Error("internal", f"{type(exc).__name__}: {exc}")
        finally:
            self.store.metrics.op_seconds.labels(op).observe(time.perf_counter() - start)

    def _dispatch(self, owner: int, request: Request) -> Reply:
        store = self.store
        match request:
            case Lookup():
                tiers = store.lookup(_keys(request.keys))
                if self._log_file is not None and request.namespace:
                    self._access(request, tiers)
                return LookupReply(tiers)
            case Lease():
                return self._lease_reply(store.lease(owner, _keys(request.keys)))
            case Wait():
                timeout = min(max(request.timeout_s, 0.0), MAX_WAIT_S)
                return _status(store.wait(request.lease_id, timeout, owner))
            case Release():
                store.release(request.lease_id, owner)
                return CountReply(1)
            case Reserve():
                slots = store.reserve(owner, request.namespace_fp, _keys(request.keys),
                                      payload_len=request.payload_len, tokens=request.tokens,
                                      priority=request.priority, first_index=request.first_index)
                return ReserveReply(slots)
            case Commit():
                return CountReply(store.commit(_keys(request.keys), owner))
            case Abort():
                return CountReply(store.abort(_keys(request.keys), owner))
            case SetPriority():
                store.set_priority(_keys(request.keys), request.priority)
                return CountReply(len(request.keys))
            case Stats():
                return StatsReply(store.stats())
            case Report():
                return CountReply(self._report(request))
            case Hello():
                if request.version != PROTOCOL_VERSION:
                    raise ValueError(f"client speaks protocol {request.version}, this server "
                                     f"speaks {PROTOCOL_VERSION}: upgrade one of them")
                return self.hello()
        raise ValueError(f"unsupported request {type(request).__name__}")

    def _report(self, request: Report) -> int:
        items = []
        for key, value in request.counters.items():
            event, _, tier = key.partition("|")
            labels = (request.client, event, tier) if tier else (request.client, event)
            bad = [label for label in labels if not _LABEL.fullmatch(label)]
            if bad:
                raise ValueError(f"report: {bad[0]!r} is not a name of 1-64 [A-Za-z0-9_.:-]")
            if not 0 <= value < 1e15:
                raise ValueError(f"report: {key} must be a non-negative increment")
            items.append((event, tier, value))
        for event, tier, value in items:  # all or nothing
            self.store.metrics.engine_events.labels(request.client, event, tier).inc(value)
        return len(items)

    def hello(self) -> HelloReply:
        arena = self.store.arena
        return HelloReply(__version__, arena.name, arena.num_slots, arena.slot_bytes,
                          HEADER_SIZE, self.store.config.lease_ttl_s, self.instance)

    def _lease_reply(self, record: LeaseRecord) -> LeaseReply:
        status = _status(record)
        return LeaseReply(record.lease_id, [i.slot for i in record.items],
                          [i.tier for i in record.items], all(status.ready))

    def _access(self, request: Lookup, tiers: list[str]) -> None:
        line = json.dumps({
            "ts": round(time.time(), 6), "ns": request.namespace, "op": "lookup",
            "chunk_tokens": request.chunk_tokens, "prompt_tokens": request.prompt_tokens,
            "keys": [k.hex()[:16] for k in request.keys],
            "tiers": tiers + [None] * (len(request.keys) - len(tiers)),
        }, separators=(",", ":"))
        with self._log_lock:
            assert self._log_file is not None
            self._log_file.write(line + "\n")

    def close(self) -> None:
        if self._log_file is not None:
            self._log_file.close()


def _status(record: LeaseRecord) -> LeaseStatus:
    ready = [i.state is ItemState.READY for i in record.items]
    failed = [i.state is ItemState.FAILED for i in record.items]
    return LeaseStatus(ready, failed, record.done)
