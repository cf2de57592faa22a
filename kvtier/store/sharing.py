"""Keeping one server's books of a shared tier in step with the other servers'.

Every server indexes the whole shared tier in its own books (``LowerTierState``), so a lookup
never asks the network. The books start from a listing and follow the tier's journal
(:mod:`kvtier.store.journal`)::

    this server ── writes, deletes, hits ──► outbox ──(every journal_interval_s)──► note
    other servers' notes ──(every poll_s)──► applied to the books: "+" index, "-" forget,
                                             "t" move up in the eviction order

so a chunk another server wrote is found within about ``journal_interval_s + poll_s``. The
eviction order of a shared tier is therefore (nearly) the same on every server: when one needs
room it deletes the chunks all of them would pick, and the total stays within
``capacity_bytes`` plus what all servers write while the journal catches up. The server with
the smallest id among fresh heartbeats also sweeps (:mod:`kvtier.store.sweeper`): namespace
budgets, old journal notes, temporary objects of killed writers.

A thread per shared tier keeps the time; every I/O runs as a job on the tier's pool (bounded
by ``io_timeout_s``, counted by the breaker) or, for the long sweep, on a pool of its own.
Journal I/O is skipped while the breaker is open; a server that fell further behind than
``journal_keep_s`` lists the tier again.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

import msgspec

from kvtier import __version__
from kvtier.errors import TierError
from kvtier.keys import ChunkKey
from kvtier.store import journal
from kvtier.store.housekeeping import Locked
from kvtier.store.iopool import IOPool, Job
from kvtier.store.lower import LowerTierState
from kvtier.store.sweeper import HEARTBEAT_S, SERVERS, sweep, sweeper_of
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.shared import SharedTier

log = logging.getLogger("kvtier.store")
MAX_OUTBOX = 100_000
MAX_TOUCHED = 100_000
MAX_TO_TOUCH = 10_000
"""Touches waiting for the backend; past this the oldest are dropped (best effort)."""
TOUCH_BATCH = 256


class Sharing:
    def __init__(self, state: LowerTierState, server: str, locked: Locked,
                 reading: Callable[[LowerTierState, Hashable], bool],
                 on_sweep: Callable[[str, int, int], None] = lambda _t, _n, _b: None) -> None:
        assert isinstance(state.tier, SharedTier)
        self.state = state
        self.tier: SharedTier = state.tier
        self.opts = state.tier.sharing
        self.server = server
        self.locked = locked
        self.reading = reading
        self.on_sweep = on_sweep
        self.outbox: list[journal.Record] = []
        self._seq = itertools.count()
        self._cursor_ms = 0
        self._seen: dict[str, int] = {}
        self._warned_ahead = False
        self._touched: OrderedDict[ChunkKey, float] = OrderedDict()
        self._to_touch: deque[tuple[ChunkKey, bytes]] = deque()
        self.touches_dropped = 0
        """Backend touches given up (the queue was full, or the tier failed a touch)."""
        self._busy: set[str] = set()
        self._due: dict[str, float] = {"sweep": time.monotonic() + self.opts.sweep_interval_s}
        """When each kind of job is next due (the first sweep waits one interval)."""
        self._sweeps = IOPool(f"{state.name}-sweep", 1,
                              max(state.config.io_timeout_s, 4 * self.opts.sweep_interval_s))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0
        """Journal records given up because the tier stayed unreachable (peers see those
        changes only when they list the tier again: at worst a miss)."""

    # ------------------------------------------------------------------ lifecycle

    def listed(self, started_ms: int) -> None:
        """The books were just built from a full listing begun at ``started_ms``."""
        self._cursor_ms = started_ms

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"kvtier-{self.state.name}-sharing")
        self._thread.start()

    def close(self, wait_s: float = 2.0) -> None:
        """Publish what is still in the outbox (briefly), stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)
        if self.outbox and self.state.available:
            self._publish_now()
        self._sweeps.close(0)

    # ------------------------------------------------------------------ under the store lock

    def wrote(self, key: ChunkKey, namespace: bytes, size: int) -> None:
        self._add(journal.Record("+", namespace, key, size))

    def deleted(self, key: ChunkKey, namespace: bytes) -> None:
        self._add(journal.Record("-", namespace, key))

    def used(self, key: ChunkKey, namespace: bytes) -> None:
        """A hit: tell the others (and the backend's recency) at most once per interval."""
        now = time.monotonic()
        last = self._touched.get(key)
        if last is not None and now - last < self.opts.touch_interval_s:
            return
        self._touched[key] = now
        self._touched.move_to_end(key)
        if len(self._touched) > MAX_TOUCHED:
            self._touched.popitem(last=False)
        self._add(journal.Record("t", namespace, key))
        if len(self._to_touch) >= MAX_TO_TOUCH:
            self._to_touch.popleft()
            self.touches_dropped += 1
        self._to_touch.append((key, namespace))

    def _add(self, record: journal.Record) -> None:
        self.outbox.append(record)
        if len(self.outbox) > MAX_OUTBOX:
            del self.outbox[: len(self.outbox) - MAX_OUTBOX]
            self.dropped += 1

    def apply(self, records: list[journal.Record]) -> None:
        """Another server's records (lock held)."""
        state = self.state
        for r in records:
            if r.op == "+":
                if r.key in state:
                    state.policy.touch(r.key)
                elif r.key not in state.deleting:
                    state.index(r.key, r.size, 35, r.namespace)
            elif r.op == "-":
                state.forget(r.key)
            else:
                state.policy.touch(r.key)

    # ------------------------------------------------------------------ the clock

    def _loop(self) -> None:
        tick = min(self.opts.journal_interval_s, self.opts.poll_s) / 2
        while not self._stop.wait(tick):
            try:
                self.run()
            except Exception:  # keep sharing alive; the next tick retries
                log.exception("sharing on tier %s failed", self.state.name)

    def run(self) -> None:
        """Start whatever is due (each kind of job runs one at a time)."""
        if not self.state.available:
            return
        now = time.monotonic()
        if self.outbox:
            self._start("publish", now, self.opts.journal_interval_s, self._publish)
        self._start("poll", now, self.opts.poll_s, self._poll)
        self._start("heartbeat", now, HEARTBEAT_S, self._heartbeat)
        if self._to_touch:
            self._start("touch", now, self.opts.journal_interval_s, self._touch)
        if "sweep" not in self._busy and now >= self._due.get("sweep", 0.0):
            self._due["sweep"] = now + self.opts.sweep_interval_s
            self._busy.add("sweep")
            self._sweeps.submit(self._job("sweep", self._sweep),
                                on_abandon=lambda: self._busy.discard("sweep"))

    def _start(self, kind: str, now: float, every: float, fn: Callable[[], None]) -> None:
        if kind in self._busy or now < self._due.get(kind, 0.0):
            return
        self._due[kind] = now + every
        self._busy.add(kind)
        self.state.pool.submit(self._job(kind, fn), on_abandon=lambda: self._busy.discard(kind))

    def _job(self, kind: str, fn: Callable[[], None]) -> Callable[[Job], None]:
        def run(_job: Job) -> None:
            start = time.perf_counter()
            error = ""
            try:
                fn()
            except TierError as exc:
                error = str(exc)
                log.debug("%s on tier %s failed: %s", kind, self.state.name, exc)
            finally:
                self._busy.discard(kind)
            if kind not in ("sweep", "touch"):  # touches are counted one by one
                with self.locked("sharing"):
                    self.state.breaker.record(not error, time.perf_counter() - start, error)
        return run

    # ------------------------------------------------------------------ jobs (I/O threads)

    def _publish(self) -> None:
        with self.locked("sharing"):
            records, self.outbox = self.outbox[:4096], self.outbox[4096:]
        if not records:
            return
        try:
            self.tier.put_note(journal.note_name(int(time.time() * 1000), self.server,
                                                 next(self._seq)), journal.encode(records))
        except TierError:
            with self.locked("sharing"):
                self.outbox[:0] = records  # tried again next time (the tier may be back)
            raise

    def _publish_now(self) -> None:
        try:
            self._publish()
        except TierError as exc:
            log.warning("tier %s: %d journal records not published at close: %s",
                        self.state.name, len(self.outbox), exc)

    def _poll(self) -> None:
        now_ms = int(time.time() * 1000)
        if self._cursor_ms < now_ms - int(self.opts.journal_keep_s * 900):
            self._relist(now_ms)
            return
        names = self.tier.list_notes(journal.PREFIX,
                                     journal.start_after(self._cursor_ms
                                                         - int(journal.SKEW_S * 1000)))
        for name in names:
            parsed = journal.parse_name(name)
            if parsed is None or name in self._seen:
                continue
            ms, server = parsed
            if server != self.server:  # a TierError here leaves the note to the next poll
                data = self.tier.get_note(name)
                if data is not None:  # None: deleted (swept) meanwhile
                    with self.locked("journal"):
                        self.apply(journal.decode(data))
            self._seen[name] = ms
            self._advance(ms, now_ms)
        floor = self._cursor_ms - 2 * int(journal.SKEW_S * 1000)
        self._seen = {n: ms for n, ms in self._seen.items() if ms >= floor}

    def _advance(self, ms: int, now_ms: int) -> None:
        """Move the cursor to a note applied, never past this server's clock: a note dated
        ahead (a peer whose clock runs fast) must not blind this reader to the others'."""
        if ms > now_ms + int(journal.SKEW_S * 1000) and not self._warned_ahead:
            self._warned_ahead = True
            log.warning("tier %s: journal notes dated %.0f s ahead of this server's clock "
                        "(a server's clock is off by more than %g s)", self.state.name,
                        (ms - now_ms) / 1000, journal.SKEW_S)
        self._cursor_ms = max(self._cursor_ms, min(ms, now_ms))

    def _relist(self, now_ms: int) -> None:
        """Too far behind the journal: make the books match a fresh listing."""
        found = sorted(self.tier.scan(), key=lambda c: c.mtime)
        listed = {c.key for c in found}
        state = self.state
        with self.locked("journal"):
            for key in [k for k in state.sizes if k not in listed]:
                state.forget(key)
            for chunk in found:
                if chunk.key not in state and chunk.key not in state.deleting:
                    state.index(chunk.key, chunk.size, 35, chunk.namespace)
        self._cursor_ms = now_ms
        log.info("tier %s: books rebuilt from a listing (%d chunks)", state.name, len(found))

    def _heartbeat(self) -> None:
        beat = {"t": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "version": __version__}
        self.tier.put_note(f"{SERVERS}{self.server}", msgspec.msgpack.encode(beat))

    def _touch(self) -> None:
        """Refresh a batch of hits' recency in the backend, each touch one operation for the
        breaker (a long batch is not one slow operation). The first failure drops the rest
        of the batch: touches are best effort."""
        with self.locked("sharing"):
            count = min(TOUCH_BATCH, len(self._to_touch))
            batch = [self._to_touch.popleft() for _ in range(count)]
        for done, (key, namespace) in enumerate(batch):
            start = time.perf_counter()
            try:
                self.tier.touch(key, namespace=namespace)
            except TierError as exc:
                with self.locked("sharing"):
                    self.state.breaker.record(False, time.perf_counter() - start, str(exc))
                    self.touches_dropped += len(batch) - done
                raise
            with self.locked("sharing"):
                self.state.breaker.record(True, time.perf_counter() - start)

    def _sweep(self) -> None:
        now = time.time()
        if sweeper_of(self.tier, now) != self.server:
            return
        report = sweep(self.tier, self.state.configured,
                       keep=lambda key: self.reading(self.state, key),
                       deleted=self._swept, now=now)
        if report.deleted:
            log.info("tier %s: swept %d chunks (%d bytes) to keep namespace budgets",
                     self.state.name, len(report.deleted), report.deleted_bytes)
        self.on_sweep(self.state.name, len(report.deleted), report.deleted_bytes)

    def _swept(self, chunks: list[StoredChunk]) -> None:
        with self.locked("journal"):
            for chunk in chunks:
                self.state.forget(chunk.key)
                self.deleted(chunk.key, chunk.namespace)
