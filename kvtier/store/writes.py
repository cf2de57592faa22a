"""Copies from the arena down to lower tiers, and deletes in them.

- write-through: a committed (or hit) chunk is copied to every write-through tier that admits
  it, in the background;
- write-back: a chunk the arena evicts is copied to the write-back tiers first, and its slot
  is freed when the last copy is done (``demoting``);
- deletes: chunks a lower tier evicts to make room, deleted by the job that needs the room
  (before its own write, so the space is really free by then).

Each (chunk, tier) write is one job on that tier's I/O pool. The slot stays put while any
job reads it (``entry.writing``). The job's outcome is applied by the store
(:mod:`kvtier.store.locking`) in :meth:`Writes._done`; a job the pool gives up (queued past
``io_timeout_s``) is undone in :meth:`Writes._abandoned`, so no entry is ever left "writing"
forever. Eviction from the arena is a write-back or a drop, so the arena's room is made here
too (:meth:`Writes.take`, :meth:`Writes.free_ahead`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from kvtier.auth import Keyring
from kvtier.codec import stored_size
from kvtier.errors import TierError, TierFull
from kvtier.keys import ChunkKey
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.store.arena_index import ArenaIndex
from kvtier.store.iopool import Job
from kvtier.store.locking import Apply
from kvtier.store.lower import LowerTierState
from kvtier.store.placement import Refusal, free_ahead, make_slot, write_targets
from kvtier.store.quotas import ARENA_TIER, Quotas
from kvtier.store.records import Entry, Where
from kvtier.tiers.base import Space

if TYPE_CHECKING:
    from kvtier.metrics import StoreMetrics

log = logging.getLogger("kvtier.store")
DELETE_TRIES = 3
"""Tries of one delete (an evicted chunk's) before it is left for the tier's next listing."""


class Writes:
    def __init__(self, index: ArenaIndex, tiers: list[LowerTierState], metrics: StoreMetrics,
                 apply: Apply, reading: Callable[[LowerTierState, Hashable], bool],
                 keyring: Keyring | None = None, quotas: Quotas | None = None) -> None:
        self.index = index
        self.quotas = quotas
        """Whose pins may come along with a copy (:mod:`kvtier.store.quotas`)."""
        self.keyring = keyring if any(s.tier.shared for s in tiers) else None
        """Signs every chunk sealed here when a shared tier may receive it."""
        self.tiers = tiers
        self.metrics = metrics
        self.apply = apply
        self.reading = reading
        """Whether a promotion reads ``key`` from a tier now (it must not be deleted)."""
        self.in_flight = 0
        self.demoting = 0
        self._arena_evictions = metrics.evictions.labels("arena", "capacity")  # once per chunk

    # ------------------------------------------------------------------ room in the arena

    def take(self, key: ChunkKey, where: Where, priority: int,
             until: float | None = None) -> Entry | None:
        """A slot for ``key``, evicting from the arena as needed; ``None``: no room now."""
        if not make_slot(self._slot_free, self.index.victim, self.evict):
            return None
        return self.index.take(key, where, priority, until)

    def _slot_free(self) -> bool:
        return self.index.free_slots > 0

    def free_ahead(self, target: int) -> None:
        """Keep ``target`` slots free or on their way to free (write-back ahead)."""
        free_ahead(lambda: self.index.free_slots + self.demoting < target, self.index.victim,
                   self.evict)

    # ------------------------------------------------------------------ deciding

    def through(self, entry: Entry) -> None:
        """Copy a READY chunk to the write-through tiers that want it."""
        targets = self.targets(entry, back=False)
        if targets:
            self.index.rescue(entry)
            self.submit(entry, targets)

    def back_all(self) -> None:
        """Copy every arena chunk to the write-back tiers that want it (graceful close)."""
        for entry in list(self.index.ready()):
            targets = self.targets(entry, back=True)
            if targets:
                self.submit(entry, targets)

    def evict(self, entry: Entry) -> bool:
        """``entry`` left the arena's eviction order: write it back, or drop it.

        Returns whether its slot is free now (after a write-back it is freed later).
        """
        self._arena_evictions.inc()
        targets = self.targets(entry, back=True)
        if targets:
            self.index.start_demotion(entry)
            self.demoting += 1
            self.submit(entry, targets)
            if entry.demoting:  # some write is under way
                return False
        else:
            self.index.drop(entry)
        return entry.key not in self.index.entries

    def targets(self, entry: Entry, back: bool) -> list[LowerTierState]:
        """The write-back (``back``) or write-through tiers a copy of ``entry`` goes to
        (:func:`~kvtier.store.placement.write_targets`); refusals are counted."""
        return write_targets([s for s in self.tiers if s.write_back == back], entry.key,
                             lambda s: s.name in entry.writing, self.index.retention(entry)[0],
                             entry.prefix_tokens, refused=self._refused)

    def _refused(self, state: LowerTierState, why: Refusal) -> None:
        if why != "held":
            self.metrics.admission_refusals.labels(state.name, why).inc()

    def submit(self, entry: Entry, targets: list[LowerTierState]) -> None:
        size = stored_size(entry.payload_len)
        for state in targets:
            room = state.make_room(size, functools.partial(self.reading, state))
            if room is None:
                self.metrics.admission_refusals.labels(state.name, "full").inc()
                continue
            victims = room.victims
            if room.forgotten:  # a peer's booking is forgotten, never deleted here
                self.metrics.evictions.labels(state.name, "booking").inc(room.forgotten)
            for key, _namespace in victims:
                self.metrics.evictions.labels(state.name, "capacity").inc()
                state.mark_deleting(key)
            self.index.start_write(entry, state.name)
            self.in_flight += 1
            try:
                state.pool.submit(functools.partial(self._job, entry=entry, state=state,
                                                    doomed=victims, size=size),
                                  on_abandon=functools.partial(self._abandoned, entry, state,
                                                               victims, size),
                                  on_late=functools.partial(self._late, state))
            except RuntimeError:  # the store is closing: give back what this write took
                for key, _namespace in victims:  # left for the next start's listing
                    state.clear_deleting(key)
                self._done(entry, state, size, None, 0.0, "")
        if entry.demoting and not entry.writing:  # no tier took it
            self._demoted(entry)

    # ------------------------------------------------------------------ doing (I/O thread)

    def _job(self, job: Job, entry: Entry, state: LowerTierState,
             doomed: list[tuple[ChunkKey, bytes]], size: int) -> None:
        for key, namespace in doomed:
            try:
                self.delete_now(state, key, namespace)
            except Exception:  # a bug in a delete must not lose this write's outcome
                log.exception("delete from %s failed", state.name)
        view = self.index.arena.slot(entry.slot)
        written: int | None = None
        error = ""
        full = False
        start = time.perf_counter()
        try:
            if self.index.seal(entry, view, self.keyring):
                written = state.tier.write(entry.key, view[:size])
            else:
                error = "cannot seal the chunk"
        except TierFull as exc:
            full, error = True, str(exc)
        except TierError as exc:
            error = str(exc)
        except Exception as exc:  # a bug must not leave the entry "writing" forever
            log.exception("write to %s failed", state.name)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            view.release()
        elapsed = time.perf_counter() - start
        space = _space(state) if full else None

        def outcome() -> None:
            if not job.late:
                state.breaker.record(written is not None or full, elapsed, error)
            if full:
                state.learn_space(space, full=True)
            self._done(entry, state, size, written, elapsed, error)

        self.apply("write", outcome, wake=True)

    def delete_now(self, state: LowerTierState, key: ChunkKey, namespace: bytes,
                   tries: int = 1) -> None:
        """Delete ``key`` from the tier in this (I/O) thread, then clear its mark; a delete
        that fails is queued again, up to ``DELETE_TRIES`` in all (``tries``: this one's)."""
        gone = False
        try:
            state.tier.delete(key, namespace=namespace)
            gone = True
        except TierError as exc:
            log.warning("delete from %s failed: %s", state.name, exc)
            self.metrics.io_errors.labels(state.name, "delete").inc()
        finally:
            self.apply("delete", functools.partial(self._delete_done, state, key, namespace,
                                                   tries, gone), wake=True)

    def _delete_done(self, state: LowerTierState, key: ChunkKey, namespace: bytes,
                     tries: int, gone: bool) -> None:
        if gone:
            state.deleted(key, namespace)
        else:
            state.clear_deleting(key)
            self._retry_delete(state, key, namespace, tries)

    def delete_later(self, state: LowerTierState, key: ChunkKey, namespace: bytes,
                     tries: int = 1) -> None:
        """Queue a delete of a chunk already gone from the tier's books (lock held)."""
        state.mark_deleting(key)
        try:
            state.pool.submit(lambda _job: self.delete_now(state, key, namespace, tries),
                              on_abandon=lambda: self._delete_abandoned(state, key, namespace,
                                                                        tries))
        except RuntimeError:  # closing: left for the next start's listing
            state.clear_deleting(key)

    def _delete_abandoned(self, state: LowerTierState, key: ChunkKey, namespace: bytes,
                          tries: int) -> None:
        state.clear_deleting(key)
        self.metrics.io_timeouts.labels(state.name, "delete").inc()
        self._retry_delete(state, key, namespace, tries)

    def _retry_delete(self, state: LowerTierState, key: ChunkKey, namespace: bytes,
                      tries: int) -> None:
        """A delete failed or was given up (lock held): queue it again, or give up on it."""
        if key in state:  # indexed again meanwhile (a peer wrote it): keep it
            return
        if tries < DELETE_TRIES:
            self.delete_later(state, key, namespace, tries + 1)
        else:
            log.warning("tier %s: chunk %s not deleted after %d tries; left on the tier for "
                        "its next listing", state.name, key.hex()[:16], tries)

    # ------------------------------------------------------------------ outcomes (lock held)

    def _done(self, entry: Entry, state: LowerTierState, promised: int, written: int | None,
              elapsed: float, error: str) -> None:
        self.index.end_write(entry, state.name)
        self.in_flight -= 1
        if written is None:
            state.release(promised)
            if error:
                self.metrics.io_errors.labels(state.name, "write").inc()
        else:
            priority, until = self.carried(ARENA_TIER, state, entry.key, written,
                                           self.index.retention(entry))
            state.stored(entry.key, written, promised, priority, entry.namespace_fp, until)
            self.metrics.bytes.labels(state.name, "write").inc(written)
            self.metrics.io_seconds.labels(state.name, "write").observe(elapsed)
        if entry.demoting and not entry.writing:
            self._demoted(entry)

    def carried(self, source: str, state: LowerTierState | None, key: ChunkKey, size: int,
                retention: tuple[int, float | None]) -> tuple[int, float | None]:
        """The retention a copy of ``key`` from ``source`` keeps in ``state`` (None: the
        arena): the same, within the quota there of the tenant that pinned it, else the
        default. The copy is charged ``size`` in a lower tier and a whole slot in the arena,
        as a reservation is, whatever its stored size."""
        if retention[0] <= DEFAULT_PRIORITY or self.quotas is None or not self.quotas.active:
            return retention
        if state is None:
            ok = self.quotas.carry(source, ARENA_TIER, key, self.index.arena.slot_bytes,
                                   self.index.pinned)
        else:
            ok = self.quotas.carry(source, state.name, key, size, state.pinned)
        return retention if ok else (DEFAULT_PRIORITY, None)

    def _late(self, state: LowerTierState) -> None:
        """The write runs past the timeout: a failure for the breaker (its own ending, if
        it ever returns, is not counted again)."""
        state.breaker.record(False, state.config.io_timeout_s, "write timed out")
        self.metrics.io_timeouts.labels(state.name, "write").inc()

    def _abandoned(self, entry: Entry, state: LowerTierState,
                   doomed: list[tuple[ChunkKey, bytes]], size: int) -> None:
        """The pool gave the job up before it ran (the tier hangs)."""
        for key, namespace in doomed:  # never deleted: queued again (bounded tries)
            state.clear_deleting(key)
            self._retry_delete(state, key, namespace, 1)
        state.breaker.record(False, state.config.io_timeout_s, "write timed out in the queue")
        self.metrics.io_timeouts.labels(state.name, "write").inc()
        self._done(entry, state, size, None, 0.0, "")

    def _demoted(self, entry: Entry) -> None:
        self.demoting -= 1
        self.index.end_demotion(entry)


def _space(state: LowerTierState) -> Space | None:
    """The tier's free space after it said it is full; None if it cannot say (its mount
    gone, say): the write's outcome is applied either way."""
    try:
        return state.tier.space()
    except Exception:
        log.warning("%s: its free space is unknown after it filled", state.name, exc_info=True)
        return None
