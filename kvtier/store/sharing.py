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

This server's writes, deletes, hits and retentions (a ``+`` again, with the retention: a
peer holding the chunk keeps it so, :mod:`kvtier.store.peer_retention`) reach the outbox as a
listener of the tier's books
(:meth:`Sharing.tier_changed`, :mod:`kvtier.store.changes`): only changes made ``HERE`` are
recorded, so what was applied from the others' notes (``PEER``) or a listing is never
echoed back.

A thread per shared tier keeps the time; every I/O runs as a job on the tier's pool (bounded
by ``io_timeout_s``, counted by the breaker) or, for the long sweep, on a pool of its own.
Journal I/O is skipped while the breaker is open; a server that fell further behind than
``journal_keep_s`` lists the tier again. A job that runs past its pool's timeout (a hung
mount) no longer holds its kind: the next one starts on a spare worker.

What the other servers wrote is untrusted input (docs/security.md): a note is size-checked
before it is fetched, opened (with a cluster secret: its MAC checked), decoded and validated
outside the store lock, and applied in batches of ``APPLY_BATCH`` records, so no note holds
the lock for long; what fails is dropped and counted (``kvtier_untrusted_total``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import TypeVar, cast

import msgspec

from kvtier.auth import Keyring, NoteRefusal, Why
from kvtier.errors import NoteTooLarge, TierError
from kvtier.keys import ChunkKey
from kvtier.policies.retention import DEFAULT_PRIORITY
from kvtier.store import journal
from kvtier.store.bookings import Limit
from kvtier.store.changes import Change, Origin, TierChange
from kvtier.store.iopool import IOPool, Job
from kvtier.store.locking import Apply
from kvtier.store.lower import LowerTierState
from kvtier.store.peer_retention import Caps, capped
from kvtier.store.sweeper import HEARTBEAT_S, SERVERS, sweep, sweeper_of
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.shared import SharedTier
from kvtier.version import __version__

log = logging.getLogger("kvtier.store")
MAX_OUTBOX = 100_000
MAX_TOUCHED = 100_000
MAX_TO_TOUCH = 10_000
"""Touches waiting for the backend; past this the oldest are dropped (best effort)."""
TOUCH_BATCH = 256
APPLY_BATCH = 32
"""Records applied per hold of the store lock."""
APPLY_PAUSE_S = 0.0001
"""The pause between two holds of one note's batches: long enough for a thread waiting on
the lock (a lookup) to take the interpreter and the lock, instead of waiting out the
interpreter's switch interval (5 ms) once per batch while this thread takes both again."""
MAX_PAGES = 10
"""Listing pages one poll reads at most (each at most MAX_LISTED_NOTES names)."""

T = TypeVar("T")
X = TypeVar("X")
_END = object()
Untrusted = Callable[[str, str, int], None]
"""Told (tier, what, count) of untrusted input dropped."""
Refused = Callable[[str, Limit, int], None]
"""Told (tier, limit, count) of peers' records refused past a bound of bookings."""


class Sharing:
    def __init__(self, state: LowerTierState, server: str, apply: Apply,
                 reading: Callable[[LowerTierState, Hashable], bool],
                 on_sweep: Callable[[str, int, int], None] = lambda _t, _n, _b: None,
                 keyring: Keyring | None = None,
                 untrusted: Untrusted = lambda _t, _w, _n: None,
                 refused: Refused = lambda _t, _l, _n: None) -> None:
        assert isinstance(state.tier, SharedTier)
        self.keyring = keyring
        self.untrusted = untrusted
        self.refused = refused
        self.rejected: dict[str, int] = {}
        """Untrusted input dropped so far, by what it was."""
        self._warned: set[str] = set()
        self.state = state
        self.tier: SharedTier = state.tier
        self.opts = state.tier.sharing
        self.server = server
        self.apply = apply
        """The store's gate for every change of its books (:mod:`kvtier.store.locking`)."""
        self._waited = threading.local()
        """Per I/O thread: the seconds of the running job's slowest call of the tier."""
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
        self._busy_lock = threading.Lock()
        self._busy: dict[str, object] = {}
        """The job now holding each kind (a late job's token is replaced, so its ending
        does not free the kind from under its successor)."""
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

    def tier_changed(self, change: TierChange) -> None:
        """A change of the tier's books: this server's own are recorded for the others; a
        peer's or a listing's are theirs already (never echoed back)."""
        if change.origin is not Origin.HERE:
            return
        if change.change is Change.ADDED:
            priority, retain_s = self._retention(change)
            self._add(journal.Record("+", change.namespace, change.key, change.size,
                                     priority, retain_s))
        elif change.change is Change.DELETED:
            self._add(journal.Record("-", change.namespace, change.key))
        elif change.change is Change.USED:
            self._used(change.key, change.namespace)
        elif change.change is Change.RETAINED and change.priority > DEFAULT_PRIORITY:
            priority, retain_s = self._retention(change)  # peers only raise theirs
            if priority is not None:
                self._add(journal.Record("+", change.namespace, change.key, change.size,
                                         priority, retain_s))

    def _retention(self, change: TierChange) -> tuple[int | None, float | None]:
        """What a ``+`` record says of the chunk's retention: its priority and the seconds
        left (``None, None``: the default, or run out)."""
        if change.priority == DEFAULT_PRIORITY:
            return None, None
        if change.until is None:
            return change.priority, None
        left = change.until - self.state.clock()
        return (change.priority, left) if left > 0 else (None, None)

    def _used(self, key: ChunkKey, namespace: bytes) -> None:
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

    def apply_records(self, records: list[journal.Line], peer: str) -> None:
        """``peer``'s records, already validated (lock held; at most APPLY_BATCH): its
        puts are its bookings (:meth:`LowerTierState.book`), refused past their bounds;
        the changes are the peer's (``PEER``), not recorded here again."""
        state = self.state
        refused: dict[Limit, int] = {}
        for op, namespace, key, size, priority, until in records:
            if op == "+":
                if key in state:
                    state.touch(key)
                    if priority is not None and until is not None:
                        state.retain(key, priority, until)
                elif key not in state.deleting:
                    retention = (DEFAULT_PRIORITY, None) if priority is None else (priority,
                                                                                   until)
                    limit = state.book(key, size, namespace, peer, retention)
                    if limit is not None:
                        refused[limit] = refused.get(limit, 0) + 1
            elif op == "-":
                state.forget(key, origin=Origin.PEER)
            else:
                state.touch(key)
        for limit, count in refused.items():
            self.refused(state.name, limit, count)

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
        self._sweep_overdue()
        if not self.state.available:
            return
        now = time.monotonic()
        if self.outbox:
            self._start("publish", now, self.opts.journal_interval_s, self._publish)
        self._start("poll", now, self.opts.poll_s, self._poll)
        self._start("heartbeat", now, HEARTBEAT_S, self._heartbeat)
        if self._to_touch:
            self._start("touch", now, self.opts.journal_interval_s, self._touch)
        self._start("sweep", now, self.opts.sweep_interval_s, self._sweep, self._sweeps)

    def _start(self, kind: str, now: float, every: float, fn: Callable[[], None],
               pool: IOPool | None = None) -> None:
        token = object()
        with self._busy_lock:
            if kind in self._busy or now < self._due.get(kind, 0.0):
                return
            self._due[kind] = now + every
            self._busy[kind] = token
        (pool or self.state.pool).submit(self._job(kind, fn, token),
                                         on_abandon=lambda: self._free(kind, token),
                                         on_late=lambda: self._late(kind, token))

    def _free(self, kind: str, token: object) -> None:
        with self._busy_lock:
            if self._busy.get(kind) is token:
                del self._busy[kind]

    def _late(self, kind: str, token: object) -> None:
        """A job past its pool's timeout: the next of its kind may start (the late one's
        result, if it ever comes, is still used)."""
        self._free(kind, token)
        log.warning("tier %s: a %s job ran past its timeout; the next one starts without "
                    "it", self.state.name, kind)

    def _sweep_overdue(self) -> None:
        """The sweep pool has no housekeeper of its own: flag its late jobs here."""
        abandoned, late = self._sweeps.overdue()
        for job in abandoned:
            if job.on_abandon is not None:
                job.on_abandon()
        for job in late:
            if job.on_late is not None:
                job.on_late()

    @contextlib.contextmanager
    def _backend(self) -> Iterator[None]:
        """Time a call of the tier. The breaker judges a job by its slowest call, as it
        judges a chunk's read or write: not by the job's other time (waiting for the store
        lock, opening and checking notes, a busy interpreter between calls), nor by how
        many calls it made (a poll that reads a hundred notes is not one slow operation)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._waited.s = max(self._backend_time(), time.perf_counter() - start)

    def _backend_time(self) -> float:
        return float(getattr(self._waited, "s", 0.0))

    def _timed(self, items: Iterable[X]) -> Iterator[X]:
        """``items`` (a listing the tier pages lazily), each step of it timed as a call."""
        it = iter(items)
        while True:
            with self._backend():
                item = next(it, _END)
            if item is _END:
                return
            yield cast(X, item)

    def _job(self, kind: str, fn: Callable[[], None], token: object
             ) -> Callable[[Job], None]:
        def run(_job: Job) -> None:
            self._waited.s = 0.0
            error = ""
            try:
                fn()
            except TierError as exc:
                error = str(exc)
                log.debug("%s on tier %s failed: %s", kind, self.state.name, exc)
            finally:
                self._free(kind, token)
            if kind not in ("sweep", "touch"):  # touches are counted one by one
                self.apply("sharing", functools.partial(
                    self.state.breaker.record, not error, self._backend_time(), error))
        return run

    def _reject(self, what: str, count: int, why: str) -> None:
        """Count untrusted input dropped; log the first of each kind (not every one)."""
        self.rejected[what] = self.rejected.get(what, 0) + count
        self.untrusted(self.state.name, what, count)
        if what not in self._warned:
            self._warned.add(what)
            log.warning("tier %s: %s (dropped; counted in kvtier_untrusted_total"
                        "{what=\"%s\"}, not logged again)", self.state.name, why, what)

    # ------------------------------------------------------------------ jobs (I/O threads)

    def _publish(self) -> None:
        records = self.apply("sharing", self._take_outbox)
        if not records:
            return
        name = journal.note_name(int(time.time() * 1000), self.server, next(self._seq))
        data = self._sign(name, journal.encode(records))
        try:
            with self._backend():
                self.tier.put_note(name, data)
        except TierError:  # tried again next time (the tier may be back)
            self.apply("sharing", functools.partial(self._put_back, records))
            raise

    def _take_outbox(self) -> list[journal.Record]:
        n = journal.MAX_RECORDS  # one note's worth
        records, self.outbox = self.outbox[:n], self.outbox[n:]
        return records

    def _put_back(self, records: list[journal.Record]) -> None:
        self.outbox[:0] = records

    def _publish_now(self) -> None:
        try:
            self._publish()
        except TierError as exc:
            log.warning("tier %s: %d journal records not published at close: %s",
                        self.state.name, len(self.outbox), exc)

    def _sign(self, name: str, data: bytes) -> bytes:
        if self.keyring is None:
            return data
        return self.keyring.sign_note(self.tier.note_scope, name, data)

    def _poll(self) -> None:
        now_ms = int(time.time() * 1000)
        if self._cursor_ms < now_ms - int(self.opts.journal_keep_s * 900):
            self._relist(now_ms)
            return
        start = journal.start_after(self._cursor_ms - int(journal.SKEW_S * 1000))
        for name in self._timed(self.tier.iter_notes(journal.PREFIX, start, MAX_PAGES)):
            self._read_note(name, now_ms)
        floor = self._cursor_ms - 2 * int(journal.SKEW_S * 1000)
        self._seen = {n: ms for n, ms in self._seen.items() if ms >= floor}

    def _read_note(self, name: str, now_ms: int) -> None:
        """Fetch, check and apply one note (a TierError leaves it to the next poll)."""
        parsed = journal.parse_name(name)
        if parsed is None or name in self._seen:
            return
        ms, server = parsed
        if ms > now_ms + int(self.opts.max_clock_skew_s * 1000):
            self._reject("note_future", 1, f"journal note {name} is dated "
                         f"{(ms - now_ms) / 1000:.0f} s ahead of this server's clock")
            self._seen[name] = ms
            return
        if server != self.server:
            records = self._capped(self._fetch(name), (now_ms - ms) / 1000)
            self._in_batches(functools.partial(self.apply_records, peer=server), records)
        self._seen[name] = ms
        self._advance(ms, now_ms)

    def _fetch(self, name: str) -> list[journal.Line]:
        """A peer's note, opened and validated outside the lock; [] for one deleted
        meanwhile (swept) or dropped as untrusted."""
        try:
            with self._backend():
                data = self.tier.get_note(name)
        except NoteTooLarge as exc:
            self._reject("note_too_large", 1, str(exc))
            return []
        if data is None:
            return []
        if self.keyring is not None:
            opened = self.keyring.open_note(self.tier.note_scope, name, data)
            if isinstance(opened, NoteRefusal):
                self._reject(opened.why.value, 1, _refusal(name, opened, self.tier.note_scope))
                return []
            data = opened
        decoded = journal.decode(data, self.state.plausible)
        if decoded.dropped:
            self._reject("journal_record", decoded.dropped,
                         f"journal note {name} holds {decoded.dropped} records that do not "
                         f"parse or name a size no chunk here can have")
        return decoded.records

    def _capped(self, records: list[journal.Line], age_s: float) -> list[journal.Line]:
        """The records of a note ``age_s`` old, each retention capped by this tier's
        options and turned into a deadline on the store's clock (outside the lock)."""
        if all(line[4] is None for line in records):
            return records
        caps = Caps(self.opts.max_peer_priority, self.opts.max_peer_retention_s)
        now = self.state.clock()
        out: list[journal.Line] = []
        for line in records:
            op, namespace, key, size, priority, retain_s = line
            if priority is not None:
                kept = capped(priority, retain_s, age_s, caps)
                line = ((op, namespace, key, size, None, None) if kept is None
                        else (op, namespace, key, size, kept[0], now + kept[1]))
            out.append(line)
        return out

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
        state = self.state
        usable, odd = state.plausible_only(self._timed(self.tier.scan()))
        found = sorted(usable, key=lambda c: c.mtime)
        self.apply("journal", functools.partial(state.count_implausible, len(odd)))
        listed = {c.key for c in found}
        held: list[ChunkKey] = self.apply("journal", functools.partial(list, state.sizes))
        gone = [key for key in held if key not in listed]
        self._in_batches(functools.partial(_forget, state), gone)
        self._in_batches(functools.partial(_index, state), found)
        self._cursor_ms = now_ms
        log.info("tier %s: books rebuilt from a listing (%d chunks)", state.name, len(found))

    def _in_batches(self, change: Callable[[list[T]], None], items: list[T]) -> None:
        """``change`` applied to ``items`` APPLY_BATCH at a time, one hold of the store lock
        each, pausing between holds (:data:`APPLY_PAUSE_S`)."""
        for at in range(0, len(items), APPLY_BATCH):
            if at:
                time.sleep(APPLY_PAUSE_S)
            self.apply("journal", functools.partial(change, items[at:at + APPLY_BATCH]))

    def _heartbeat(self) -> None:
        beat = {"t": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "version": __version__}
        name = f"{SERVERS}{self.server}"
        data = self._sign(name, msgspec.msgpack.encode(beat))
        with self._backend():
            self.tier.put_note(name, data)

    def _touch(self) -> None:
        """Refresh a batch of hits' recency in the backend, each touch one operation for the
        breaker (a long batch is not one slow operation). The first failure drops the rest
        of the batch: touches are best effort."""
        batch = self.apply("sharing", self._touch_batch)
        for done, (key, namespace) in enumerate(batch):
            start = time.perf_counter()
            try:
                self.tier.touch(key, namespace=namespace)
            except TierError as exc:
                self.apply("sharing", functools.partial(
                    self._touch_failed, time.perf_counter() - start, str(exc),
                    len(batch) - done))
                raise
            self.apply("sharing", functools.partial(self.state.breaker.record, True,
                                                    time.perf_counter() - start))

    def _touch_batch(self) -> list[tuple[ChunkKey, bytes]]:
        count = min(TOUCH_BATCH, len(self._to_touch))
        return [self._to_touch.popleft() for _ in range(count)]

    def _touch_failed(self, elapsed: float, error: str, dropped: int) -> None:
        self.state.breaker.record(False, elapsed, error)
        self.touches_dropped += dropped

    def _sweep(self) -> None:
        now = time.time()
        if sweeper_of(self.tier, now, self.keyring, self.opts.max_clock_skew_s) != self.server:
            return
        report = sweep(self.tier, self.state.configured,
                       keep=lambda key: self.reading(self.state, key),
                       deleted=self._swept, now=now, plausible=self.state.plausible,
                       keyring=self.keyring, priority=self.state.books.policy.peek_priority)
        if report.deleted:
            log.info("tier %s: swept %d chunks (%d bytes) to keep namespace budgets",
                     self.state.name, len(report.deleted), report.deleted_bytes)
        self.on_sweep(self.state.name, len(report.deleted), report.deleted_bytes)

    def _swept(self, chunks: list[StoredChunk]) -> None:
        self.apply("journal", functools.partial(self._forget_swept, chunks))

    def _forget_swept(self, chunks: list[StoredChunk]) -> None:
        for chunk in chunks:
            self.state.swept(chunk.key, chunk.namespace)


def _refusal(name: str, refused: NoteRefusal, scope: str) -> str:
    """Why a peer's note was refused, as the log says it once per kind."""
    if refused.why is Why.OTHER_TIER:
        return (f"journal note {name} was signed for the tier {refused.scope!r}, not this "
                f"one ({scope!r}): a note copied from another tier, or a server of this tier "
                f"configured with another tier_id or fs path (set options.tier_id alike on "
                f"every server of the tier)")
    if refused.why is Why.OLD_FORMAT:
        return (f"journal note {name} was signed by a kvtier older than tier-bound notes "
                f"(upgrade every server of the tier; until then they do not see each "
                f"other's journal)")
    return f"journal note {name} is not signed with an accepted cluster secret"


def _forget(state: LowerTierState, keys: list[ChunkKey]) -> None:
    """Chunks a fresh listing no longer finds."""
    for key in keys:
        state.forget(key, origin=Origin.LISTING)


def _index(state: LowerTierState, chunks: list[StoredChunk]) -> None:
    """Chunks a listing found that the books lack (a delete queued here keeps them out),
    or hold on a peer's word alone (confirmed)."""
    for chunk in chunks:
        if chunk.key in state.bookings or (chunk.key not in state
                                           and chunk.key not in state.deleting):
            state.index(chunk.key, chunk.size, 35, chunk.namespace)
