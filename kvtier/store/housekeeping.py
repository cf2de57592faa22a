"""The store's periodic work on its lower tiers (the server runs it every half second).

- I/O past its timeout: jobs the pool abandoned (queued too long) are undone, jobs running
  too long are marked late (their waiters fail, the breaker counts them);
- circuit breakers: an open breaker whose cool-down is over gets its probe — a small sealed
  chunk written, read back, verified and deleted on the tier's own pool;
- listing again: a tier whose listing failed at start is listed once its breaker closes;
- space: every few seconds each tier's filesystem is asked what it can still hold.

Each step has the store apply only the change it makes (:mod:`kvtier.store.locking`), one
short lock hold each; the probe and ``statvfs`` run on the tier's pool, bounded by its
timeout like any other I/O.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import mmap
import time
from collections.abc import Callable

from kvtier import codec
from kvtier.errors import CorruptChunkError, TierError, TierIOError
from kvtier.keys import ChunkKey
from kvtier.store.iopool import Job
from kvtier.store.locking import Apply
from kvtier.store.lower import LowerTierState
from kvtier.store.scan import newest_that_fit
from kvtier.tiers.base import StoredChunk

log = logging.getLogger("kvtier.store")
SPACE_CHECK_S = 5.0
BATCH = 64
"""Jobs whose time ran out handled per lock hold."""
RESCAN_BATCH = 4096
"""Chunks found by a late listing indexed per lock hold."""
PROBE_NAMESPACE = bytes(32)
"""Probe chunks live in a namespace of their own (all zeros), which no engine computes."""


class Housekeeper:
    def __init__(self, tiers: list[LowerTierState], apply: Apply,
                 clock: Callable[[], float], instance: str = "") -> None:
        self.tiers = tiers
        self.instance = instance
        """This server's id: its probe chunks are its own on a tier others probe too."""
        self.apply = apply
        self.clock = clock
        self._space_checked = -SPACE_CHECK_S

    def run(self) -> None:
        for state in self.tiers:
            self._overdue(state)
            if state.full_until is not None:
                self.apply("space", state.cool_down)
            if self.apply("breaker", state.breaker.probe_due):
                self._probe(state)
            if state.rescan and state.available:
                self._rescan(state)
        now = self.clock()
        if now - self._space_checked >= SPACE_CHECK_S:
            self._space_checked = now
            for state in self.tiers:
                self._space(state)

    def _overdue(self, state: LowerTierState) -> None:
        abandoned, late = state.pool.overdue()
        calls = [j.on_abandon for j in abandoned if j.on_abandon is not None]
        calls += [j.on_late for j in late if j.on_late is not None]
        for start in range(0, len(calls), BATCH):  # a hung tier's whole queue, in batches
            self.apply("overdue", functools.partial(_call_all, calls[start : start + BATCH]),
                       wake=True)

    def _probe(self, state: LowerTierState) -> None:
        def run(job: Job) -> None:
            start = time.perf_counter()
            error = ""
            try:
                probe_tier(state, self.instance)
            except Exception as exc:  # any failure keeps the breaker open
                error = f"{type(exc).__name__}: {exc}"
            elapsed = time.perf_counter() - start
            if not job.late:
                self.apply("probe", functools.partial(state.breaker.probe_result, not error,
                                                      elapsed, error))

        def gave_up() -> None:
            state.breaker.probe_result(False, state.config.io_timeout_s, "probe timed out")

        state.pool.submit(run, on_abandon=gave_up, on_late=gave_up)

    def _rescan(self, state: LowerTierState) -> None:
        """List a tier whose listing failed at start, now that it answers again: of what it
        holds and the books lack, the newest that fit are indexed (oldest first, as at
        start); the rest stays on the tier until the next start's listing."""
        self.apply("rescan", state.start_rescan)

        def run(_job: Job) -> None:
            try:
                listed, odd = state.plausible_only(state.tier.scan())
            except TierError as exc:
                log.warning("tier %s: listing it again failed: %s", state.name, exc)
                self.apply("rescan", state.rescan_later)
                return
            self.apply("rescan", functools.partial(state.count_implausible, len(odd)))
            # a snapshot: the live check is _index_found's
            held, room = self.apply("rescan", functools.partial(_room, state))
            found, _left = newest_that_fit([c for c in listed if c.key not in held], room)
            for start in range(0, len(found), RESCAN_BATCH):
                self.apply("rescan", functools.partial(self._index_found, state,
                                                       found[start : start + RESCAN_BATCH]))
            log.info("tier %s: listed again, %d chunks, %d bytes in the books", state.name,
                     len(state.sizes), state.used)

        state.pool.submit(run, on_abandon=state.rescan_later)  # called under the lock

    @staticmethod
    def _index_found(state: LowerTierState, chunks: list[StoredChunk]) -> None:
        for chunk in chunks:
            if chunk.key in state or chunk.key in state.deleting:
                continue
            if state.used + state.reserved + chunk.size > state.capacity:
                return  # the rest stays on disk until the next start's listing
            state.index(chunk.key, chunk.size, chunk.priority, chunk.namespace)

    def _space(self, state: LowerTierState) -> None:
        def run(_job: Job) -> None:
            space = state.tier.space()
            if space is not None:
                self.apply("space", functools.partial(state.learn_space, space))

        state.pool.submit(run)


def _call_all(calls: list[Callable[[], None]]) -> None:
    """Each overdue job's callback (lock held); one that fails is logged and the rest still
    run: their jobs are already off the pool's queue, and a callback not run leaves its
    entry writing and its room reserved for good."""
    for call in calls:
        try:
            call()
        except Exception:
            log.exception("an overdue job's callback failed")


def _room(state: LowerTierState) -> tuple[set[ChunkKey], int]:
    """What the tier's books hold, and the room left in them (lock held)."""
    return set(state.sizes), state.capacity - state.used - state.reserved


def probe_key(tier: str, instance: str) -> ChunkKey:
    """The probe chunk of one server on one tier: servers probing a shared tier at once
    never write, read or delete each other's."""
    return ChunkKey(hashlib.sha256(f"kvtier-probe:{tier}:{instance}".encode()).digest())


def probe_tier(state: LowerTierState, instance: str = "") -> None:
    """Write, read back, verify and delete one small chunk; raises if any step fails."""
    key = probe_key(state.name, instance)
    size = codec.stored_size(codec.PAGE)
    buf = mmap.mmap(-1, 2 * size)  # page aligned, as O_DIRECT wants
    try:
        out, into = memoryview(buf)[:size], memoryview(buf)[size:]
        out[codec.HEADER_SIZE:] = bytes(range(256)) * (codec.PAGE // 256)
        codec.seal(out, PROBE_NAMESPACE, key, tokens=1, payload_len=codec.PAGE)
        state.tier.write(key, out)
        try:
            got = state.tier.read_into(key, into, namespace=PROBE_NAMESPACE)
            if got is None:
                raise TierIOError(f"tier {state.name}: the probe chunk vanished after writing")
            codec.verify(into[:got], key, PROBE_NAMESPACE)
            if bytes(into[:size]) != bytes(out):
                raise CorruptChunkError("the probe chunk read back differs")
        finally:
            state.tier.delete(key, namespace=PROBE_NAMESPACE)
        del out, into
    finally:
        with contextlib.suppress(BufferError):
            buf.close()
