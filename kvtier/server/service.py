"""Turns decoded requests into store calls and replies: one handler per operation.

Handlers are registered against the request types of :mod:`kvtier.protocol`; the table
must cover every type in ``REQUESTS`` (checked at import), so client and server cannot drift.

- A client's mistake (:class:`~kvtier.errors.InvalidRequest`: an unknown lease, repeated
  keys, a payload too big) gets ``Error("bad_request")`` saying what was wrong; nothing
  stored changed, because every operation checks its input before it changes anything.
- Anything else is a server bug: ``Error("internal")``, logged with its traceback, counted
  (``kvtier_internal_errors_total``), and the store's books are checked at once so a bug
  that broke them is reported, not left to corrupt later answers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from kvtier.codec import HEADER_SIZE
from kvtier.errors import IntegrityError, InvalidRequest
from kvtier.protocol import (
    MAX_WAIT_S,
    REQUESTS,
    Abort,
    Commit,
    CountReply,
    Error,
    Events,
    EventsReply,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    LeaseStatus,
    Lookup,
    LookupReply,
    Op,
    Register,
    Release,
    Reply,
    Report,
    Reserve,
    ReserveReply,
    SetPriority,
    Stats,
    StatsReply,
    Wait,
)
from kvtier.store import TieredStore
from kvtier.store.records import ItemState, LeaseRecord
from kvtier.version import __version__

log = logging.getLogger("kvtier.server")
_LABEL = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_NAMESPACES = 256

OpT = TypeVar("OpT", bound=Op[Any])
Handler = Callable[["Service", "Caller", Any], Reply]
_HANDLERS: dict[type[Op[Any]], Handler] = {}


HandlerOf = Callable[["Service", "Caller", OpT], Reply]


def handles(op: type[OpT]) -> Callable[[HandlerOf[OpT]], HandlerOf[OpT]]:
    """Register the handler of one request type."""
    def register(fn: HandlerOf[OpT]) -> HandlerOf[OpT]:
        if op in _HANDLERS:
            raise TypeError(f"two handlers for {op.__name__}")
        _HANDLERS[op] = fn
        return fn
    return register


@dataclass
class Caller:
    """Who sent a request: the owner its session acts for, and its session token."""

    owner: int
    session: str


class Service:
    def __init__(self, store: TieredStore, access_log: str | None = None,
                 max_report_series: int = 1000) -> None:
        self.store = store
        self.instance = store.instance
        self.max_report_series = max_report_series
        self.namespaces: dict[bytes, dict[str, str | int]] = {}
        """What engines registered about their namespaces (for the router and tools)."""
        self._series: set[tuple[str, str, str]] = set()
        self._series_lock = threading.Lock()
        self._log_file: IO[str] | None = None
        self._log_lock = threading.Lock()
        if access_log:
            os.makedirs(os.path.dirname(os.path.abspath(access_log)), exist_ok=True)
            fd = os.open(access_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._log_file = os.fdopen(fd, "a", buffering=1)

    def handle(self, caller: Caller, request: Op[Any]) -> Reply:
        op = type(request).__name__.lower()
        start = time.perf_counter()
        try:
            return _HANDLERS[type(request)](self, caller, request)
        except InvalidRequest as exc:
            return Error("bad_request", str(exc))
        except Exception as exc:  # a bug: the server must outlive it, and say so
            log.exception("request %s failed inside the server", op)
            self.store.metrics.internal_errors.labels(op).inc()
            self._check_books(op)
            return Error("internal", f"{type(exc).__name__}: {exc}")
        finally:
            self.store.metrics.op_seconds.labels(op).observe(time.perf_counter() - start)

    def _check_books(self, op: str) -> None:
        try:
            self.store.check_integrity()
        except IntegrityError as exc:
            log.critical("after the failed %s the store's books disagree: %s", op, exc)

    def hello(self) -> HelloReply:
        arena = self.store.arena
        return HelloReply(__version__, arena.name, arena.num_slots, arena.slot_bytes,
                          HEADER_SIZE, self.store.config.lease_ttl_s, self.instance)

    # ------------------------------------------------------------------ handlers

    @handles(Hello)
    def _hello(self, caller: Caller, request: Hello) -> Reply:
        if request.session != caller.session:
            raise InvalidRequest("a connection keeps the session of its first hello")
        return self.hello()

    @handles(Lookup)
    def _lookup(self, caller: Caller, request: Lookup) -> Reply:
        hit = self.store.lookup_hit(request.keys)
        if self._log_file is not None and request.namespace:
            self._access(request, hit.tiers)
        return LookupReply(hit.tiers, hit.arrival_s)

    @handles(Lease)
    def _lease(self, caller: Caller, request: Lease) -> Reply:
        record = self.store.lease(caller.owner, request.keys)
        status = _status(record)
        return LeaseReply(record.lease_id, [i.slot for i in record.items],
                          [i.tier for i in record.items], all(status.ready))

    @handles(Wait)
    def _wait(self, caller: Caller, request: Wait) -> Reply:
        timeout = min(request.timeout_s, MAX_WAIT_S)
        return _status(self.store.wait(request.lease_id, timeout, caller.owner))

    @handles(Release)
    def _release(self, caller: Caller, request: Release) -> Reply:
        self.store.release(request.lease_id, caller.owner)
        return CountReply(1)

    @handles(Reserve)
    def _reserve(self, caller: Caller, request: Reserve) -> Reply:
        slots = self.store.reserve(caller.owner, request.namespace_fp, request.keys,
                                   payload_len=request.payload_len, tokens=request.tokens,
                                   priority=request.priority, first_index=request.first_index,
                                   retain_s=request.retain_s, tenant=request.tenant)
        return ReserveReply(slots)

    @handles(Commit)
    def _commit(self, caller: Caller, request: Commit) -> Reply:
        return CountReply(self.store.commit(request.keys, caller.owner))

    @handles(Abort)
    def _abort(self, caller: Caller, request: Abort) -> Reply:
        return CountReply(self.store.abort(request.keys, caller.owner))

    @handles(SetPriority)
    def _set_priority(self, caller: Caller, request: SetPriority) -> Reply:
        self.store.set_priority(request.keys, request.priority, request.retain_s,
                                keep_stronger=request.keep_stronger, tenant=request.tenant)
        return CountReply(len(request.keys))

    @handles(Stats)
    def _stats(self, caller: Caller, request: Stats) -> Reply:
        return StatsReply(self.store.stats())

    @handles(Register)
    def _register(self, caller: Caller, request: Register) -> Reply:
        info = dict(request.info)
        for name in ("model", "chunk_tokens"):
            if name not in info:
                raise InvalidRequest(f"register: info needs {name!r}")
        with self._series_lock:
            if (request.namespace_fp not in self.namespaces
                    and len(self.namespaces) >= MAX_NAMESPACES):
                raise InvalidRequest(f"register: at most {MAX_NAMESPACES} namespaces")
            self.namespaces[request.namespace_fp] = info
        return CountReply(1)

    @handles(Events)
    def _events(self, caller: Caller, request: Events) -> Reply:
        events, next_seq, lost = self.store.events_since(request.since, request.limit,
                                                         request.namespace_fp)
        return EventsReply([(e.seq, e.op, e.tier, e.key) for e in events], next_seq, lost)

    @handles(Report)
    def _report(self, caller: Caller, request: Report) -> Reply:
        items = []
        for key, value in request.counters.items():
            event, _, tier = key.partition("|")
            labels = (request.client, event, tier) if tier else (request.client, event)
            bad = [label for label in labels if not _LABEL.fullmatch(label)]
            if bad:
                raise InvalidRequest(f"report: {bad[0]!r} is not a name of 1-64 "
                                     "[A-Za-z0-9_.:-]")
            if not 0 <= value < 1e15:
                raise InvalidRequest(f"report: {key} must be a non-negative increment")
            items.append((request.client, event, tier, value))
        with self._series_lock:  # all or nothing
            new = {item[:3] for item in items} - self._series
            if len(self._series) + len(new) > self.max_report_series:
                raise InvalidRequest(f"report: the server keeps at most "
                                     f"{self.max_report_series} reported series; "
                                     f"{len(new)} new ones refused")
            self._series |= new
        for client, event, tier, value in items:
            self.store.metrics.engine_events.labels(client, event, tier).inc(value)
        return CountReply(len(items))

    # ------------------------------------------------------------------ access log

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


_missing = [op.__name__ for op in REQUESTS if op not in _HANDLERS]
if _missing:
    raise TypeError(f"operations without a handler: {_missing}")
