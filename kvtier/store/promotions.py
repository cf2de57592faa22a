"""Promotions: reading a lower-tier chunk into an arena slot for the leases that wait on it.

A lease of a chunk that only a lower tier holds takes a slot for it (PROMOTING) and starts
one read on that tier's pool; later leases of the same chunk join it. When the read ends,
:meth:`Promotions._done` publishes the chunk (its waiters' items turn READY, each pinning
the slot) or drops it (they turn FAILED: a miss from there on). Every read is verified
(header, key, namespace, checksum); a corrupt copy is quarantined and forgotten, a copy that
only failed to read stays indexed, and one larger than this server's slots (a peer with bigger
slots wrote it) is a plain miss: never quarantined, still indexed (lookups skip chunks whose
size exceeds a slot). Reads are timed for the tier's :class:`ReadEstimate`.

A read still running after ``io_timeout_s`` is *late*: its waiters fail at once and no new
lease joins it, but its slot stays taken until the read returns (a late read could still
write into it). A read the pool gave up before it started frees the slot at once.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from kvtier.auth import Keyring
from kvtier.codec import stored_size, verify
from kvtier.errors import ChunkTooLarge, CorruptChunkError, TierError, UnauthenticatedChunk
from kvtier.keys import ChunkKey
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.iopool import Job
from kvtier.store.leases import LeaseTable
from kvtier.store.locking import Apply
from kvtier.store.lower import LowerTierState
from kvtier.store.records import Entry, ItemState, LeaseItem, Where

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvtier.codec import ChunkHeader
    from kvtier.metrics import StoreMetrics

log = logging.getLogger("kvtier.store")


class Promotions:
    def __init__(self, index: ArenaIndex, leases: LeaseTable, metrics: StoreMetrics,
                 apply: Apply, clock: Callable[[], float],
                 keyring: Keyring | None = None) -> None:
        self.index = index
        self.keyring = keyring
        """Checks the MAC of every chunk read from a shared tier (docs/security.md)."""
        self._forged: set[str] = set()
        """Tiers that served a chunk failing its MAC (logged once per tier)."""
        self.leases = leases
        self.metrics = metrics
        self.apply = apply
        self.clock = clock
        self.in_flight = 0
        self.late: set[ChunkKey] = set()
        """Keys whose read ran past the timeout: not joined again, slot held until it ends."""

    def begin(self, entry: Entry, state: LowerTierState) -> LeaseItem:
        """Mark ``entry`` (a fresh PROMOTING slot) as read from ``state``; the read itself is
        started by :meth:`start` once the lease is recorded."""
        self.index.promoting(entry, state.name)
        return LeaseItem(entry.key, entry.slot, state.name, ItemState.PENDING)

    def start(self, entry: Entry, state: LowerTierState) -> None:
        namespace = state.namespaces.get(entry.key, b"")
        self.in_flight += 1
        try:
            state.pool.submit(lambda job: self._job(job, entry, state, namespace),
                              on_abandon=lambda: self._abandoned(entry, state),
                              on_late=lambda: self._late(entry, state))
        except RuntimeError:  # the store is closing: the read fails, its slot is freed
            self._done(entry, state, None, False, "the store is closing", 0.0)

    def joinable(self, entry: Entry) -> bool:
        return entry.where is Where.PROMOTING and entry.key not in self.late

    # ------------------------------------------------------------------ I/O thread

    def _job(self, job: Job, entry: Entry, state: LowerTierState, namespace: bytes) -> None:
        view = self.index.arena.slot(entry.slot)
        start = time.perf_counter()
        header: ChunkHeader | None = None
        corrupt, too_large, error = False, False, ""
        try:
            n = state.tier.read_into(entry.key, view, namespace=namespace)
            if n is not None:
                keyring = self.keyring if state.tier.shared else None
                header = verify(view[:n], entry.key, namespace or None, keyring)
        except ChunkTooLarge as exc:  # written by a server with bigger slots: a plain miss
            too_large = True
            log.debug("chunk %s on %s does not fit a slot here: %s", entry.key.hex()[:16],
                      state.name, exc)
        except UnauthenticatedChunk as exc:
            corrupt, error = True, str(exc)
            self._unauthenticated(state, exc)
            self._quarantine(state, entry.key, namespace)
        except CorruptChunkError as exc:
            corrupt, error = True, str(exc)
            self._quarantine(state, entry.key, namespace)
        except TierError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must fail this load, never strand the slot
            log.exception("read from %s failed", state.name)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            view.release()
        elapsed = time.perf_counter() - start
        if corrupt and state.name in self._forged:
            log.debug("chunk %s on %s failed its MAC: %s", entry.key.hex()[:16], state.name,
                      error)
        elif corrupt:
            log.warning("chunk %s on %s is corrupt (%s): quarantined", entry.key.hex()[:16],
                        state.name, error)
        elif error:
            log.debug("read from %s failed: %s", state.name, error)
        self.apply("promote", functools.partial(self._outcome, job, entry, state, header,
                                                corrupt, error, elapsed, too_large), wake=True)

    def _outcome(self, job: Job, entry: Entry, state: LowerTierState,
                 header: ChunkHeader | None, corrupt: bool, error: str, elapsed: float,
                 too_large: bool) -> None:
        if not job.late:
            state.breaker.record(not error or corrupt, elapsed, error)
        self._done(entry, state, header, corrupt, error, elapsed, too_large=too_large)

    def _unauthenticated(self, state: LowerTierState, exc: UnauthenticatedChunk) -> None:
        """Count a chunk that failed its MAC; say so once per tier (a peer without the
        secret may write many), then only count."""
        self.metrics.untrusted.labels(state.name, "chunk_mac").inc()
        if state.name not in self._forged:
            log.warning("tier %s: a chunk failed its MAC (%s): another writer of the tier "
                        "lacks the cluster secret or forged it; such chunks are misses, "
                        "quarantined and counted (kvtier_untrusted_total{what=\"chunk_mac\"})",
                        state.name, exc)
            self._forged.add(state.name)

    def _quarantine(self, state: LowerTierState, key: ChunkKey, namespace: bytes) -> None:
        try:
            state.tier.quarantine(key, namespace=namespace)
        except TierError as exc:
            log.warning("quarantine on %s failed: %s", state.name, exc)

    # ------------------------------------------------------------------ outcomes (lock held)

    def _done(self, entry: Entry, state: LowerTierState, header: ChunkHeader | None,
              corrupt: bool, error: str, elapsed: float, *, too_large: bool = False) -> None:
        self.in_flight -= 1
        self.late.discard(entry.key)
        waiting = self.leases.waiters(entry.key)
        if header is not None:
            self.index.promoted(entry, header.namespace_fp, header.tokens, header.payload_len)
            for item in waiting:
                self.index.pin(entry)
                item.state = ItemState.READY
            nbytes = stored_size(header.payload_len)
            state.reads.observe(elapsed, nbytes, self.clock())
            state.hit(entry.key, header.namespace_fp, nbytes)
            self.metrics.bytes.labels(state.name, "read").inc(nbytes)
            self.metrics.io_seconds.labels(state.name, "read").observe(elapsed)
        else:
            if corrupt:
                self.metrics.checksum_failures.labels(state.name).inc()
            if too_large:
                pass  # the tier holds it for others: neither forgotten nor journaled
            elif error and not corrupt:
                self.metrics.io_errors.labels(state.name, "read").inc()
            else:  # missing, or corrupt and quarantined: the tier no longer holds it
                state.lost(entry.key)
            for item in waiting:
                item.state = ItemState.FAILED
            self.index.drop(entry)

    def _late(self, entry: Entry, state: LowerTierState) -> None:
        """The read runs past the timeout: its waiters stop waiting (recompute)."""
        self.late.add(entry.key)
        state.breaker.record(False, state.config.io_timeout_s, "read timed out")
        self.metrics.io_timeouts.labels(state.name, "read").inc()
        for item in self.leases.waiters(entry.key):
            item.state = ItemState.FAILED

    def _abandoned(self, entry: Entry, state: LowerTierState) -> None:
        """The pool gave the read up before it started: nothing touches the slot."""
        state.breaker.record(False, state.config.io_timeout_s, "read timed out in the queue")
        self.metrics.io_timeouts.labels(state.name, "read").inc()
        self._done(entry, state, None, False, "timed out in the queue", 0.0)
