"""The tiered store: what is cached where, kept correct, moved between tiers.

One arena (host RAM, shared with engine processes) on top, then the lower tiers in config
order. Every lower-tier hit is staged through the arena. The operations clients see:

- ``lookup(keys)``: tiers of the longest prefix of ``keys`` available now. No side effects.
- ``reserve`` -> client writes payloads into the slots -> ``commit`` (or ``abort``): the
  two-phase store. Commit makes chunks servable and starts write-through copies below.
- ``lease`` -> (``wait`` while lower-tier chunks are promoted) -> client reads -> ``release``:
  the two-phase load. A leased or in-flight slot is never evicted or reused.
- ``expire``/``drop_owner``: leases and reservations end after their TTL, or a short grace
  after their client went away.

Admission rules of lower tiers see one use per chunk per request: a leased hit or an offer
to ``reserve`` (granted or not).

All bookkeeping happens under one lock; payload I/O runs on each tier's thread pool and
reports back through ``_write_done``/``_promote_done``. Expected outcomes (a miss, no room,
a refused admission) are return values; ``check_integrity()`` raises IntegrityError when
the books disagree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvtier.codec import HEADER_SIZE, stored_size
from kvtier.entry import Entry, LeaseRecord, Where
from kvtier.integrity import check_entries
from kvtier.keys import ChunkKey
from kvtier.leasing import Leasing
from kvtier.movement import ARENA
from kvtier.policies import DEFAULT_PRIORITY, check_priority

log = logging.getLogger("kvtier.store")

__all__ = ["ARENA", "TieredStore"]


class TieredStore(Leasing):
    """See the module docstring; the state and the moves are in :class:`StoreCore`."""

    def rebuild(self) -> int:
        """Index what the lower tiers already hold (after a restart). Returns chunk count."""
        count = 0
        for state in self.tiers:
            found = sorted(state.tier.scan(), key=lambda c: c.mtime, reverse=True)
            room, kept = state.capacity - state.used, []
            for chunk in found:  # the newest fill the tier; if it shrank, the oldest go
                if chunk.size > room:
                    state.deleting.add(chunk.key)
                    state.executor.submit(self._delete_job, state, chunk.key)
                    continue
                room -= chunk.size
                kept.append(chunk)
            with self._lock:
                for chunk in reversed(kept):  # oldest first, as the eviction policy orders
                    state.added(chunk.key, chunk.size, 0, chunk.priority)
                    entry = self.entries.setdefault(chunk.key, Entry(chunk.key, chunk.priority))
                    entry.lower.add(state.name)
                    count += 1
            log.info("tier %s: indexed %d chunks, %d bytes", state.name, len(state.sizes),
                     state.used)
        self._set_gauges()
        return count

    def lookup(self, keys: Sequence[ChunkKey]) -> list[str]:
        """The tier holding each chunk of the longest prefix of ``keys`` available now."""
        with self._lock:
            tiers: list[str] = []
            for key in keys:
                tier = self._tier_of(self.entries.get(key))
                if tier is None:
                    break
                tiers.append(tier)
        self.metrics.lookup_chunks.labels("hit").inc(len(tiers))
        self.metrics.lookup_chunks.labels("miss").inc(len(keys) - len(tiers))
        return tiers

    def _tier_of(self, entry: Entry | None) -> str | None:
        if entry is None:
            return None
        if entry.where is Where.READY:
            return ARENA
        for state in self.tiers:
            if state.name in entry.lower:
                return state.name
        return None

    def reserve(self, owner: int, namespace_fp: bytes, keys: Sequence[ChunkKey], *,
                payload_len: int, tokens: int, priority: int = DEFAULT_PRIORITY,
                first_index: int = 0) -> list[int | None]:
        """A slot for each key to write its payload into; ``None`` means skip that chunk.

        Raises ValueError when the payload cannot fit a slot or the priority is invalid.
        """
        check_priority(priority)
        if len(namespace_fp) != 32:
            raise ValueError(f"namespace_fp must be 32 bytes, got {len(namespace_fp)}")
        if not 0 < tokens < 2**32 or not 0 <= first_index < 2**32:
            raise ValueError(f"tokens ({tokens}) and first_index ({first_index}) must be in "
                             "[1, 2**32) and [0, 2**32)")
        if payload_len <= 0 or stored_size(payload_len) > self.arena.slot_bytes:
            raise ValueError(
                f"payload_len {payload_len} does not fit an arena slot of "
                f"{self.arena.slot_bytes} bytes (at most "
                f"{self.arena.slot_bytes - HEADER_SIZE} payload bytes)"
            )
        deadline = self.clock() + self.config.lease_ttl_s
        slots: list[int | None] = []
        with self._lock:
            for i, key in enumerate(keys):
                self._record_use(key)
                entry = self.entries.get(key)
                if entry is not None and entry.where is not Where.ABSENT:
                    if entry.where is Where.READY:
                        self.policy.touch(key)
                        self._write_through(entry)
                    self.metrics.store_refusals.labels("present").inc()
                    slots.append(None)
                    continue
                slot = self._alloc_slot()
                if slot is None:
                    self.metrics.store_refusals.labels("arena_full").inc()
                    slots.append(None)
                    continue
                entry = entry or self.entries.setdefault(key, Entry(key, priority))
                entry.priority = max(entry.priority, priority) if entry.lower else priority
                entry.where, entry.slot, entry.owner, entry.deadline = (
                    Where.RESERVED, slot, owner, deadline)
                entry.namespace_fp, entry.tokens, entry.payload_len = (
                    namespace_fp, tokens, payload_len)
                entry.prefix_tokens, entry.sealed = (first_index + i + 1) * tokens, False
                slots.append(slot)
        return slots

    def commit(self, keys: Sequence[ChunkKey], owner: int | None = None) -> int:
        """Publish reserved chunks; returns how many were committed.

        Only the reserving client's (``owner``'s) reservations; ``None`` for in-process
        callers. Chunks are inserted tail first, so the head of a prefix is the most
        recently used.
        """
        count = 0
        with self._lock:
            for key in reversed(keys):
                entry = self.entries.get(key)
                if entry is None or not self._reserved_by(entry, owner):
                    continue
                assert entry.slot is not None
                self.arena.publish(entry.slot)
                entry.where, entry.owner = Where.READY, None
                self.policy.insert(key, entry.priority)
                self._write_through(entry)
                count += 1
            self._maintain_free()
            self._changed.notify_all()
        self._set_gauges()
        return count

    def abort(self, keys: Sequence[ChunkKey], owner: int | None = None) -> int:
        """Drop reserved chunks of ``owner`` (any, for ``None``); returns how many."""
        with self._lock:
            count = sum(self._abort_one(key, owner) for key in keys)
            self._changed.notify_all()
        return count

    def _abort_one(self, key: ChunkKey, owner: int | None) -> bool:
        entry = self.entries.get(key)
        if entry is None or not self._reserved_by(entry, owner):
            return False
        self._drop_slot(entry)
        return True

    @staticmethod
    def _reserved_by(entry: Entry, owner: int | None) -> bool:
        return entry.where is Where.RESERVED and owner in (None, entry.owner)

    def set_priority(self, keys: Sequence[ChunkKey], priority: int) -> None:
        check_priority(priority)
        with self._lock:
            for key in keys:
                entry = self.entries.get(key)
                if entry is None:
                    continue
                entry.priority = priority
                self.policy.set_priority(key, priority)
                for state in self.tiers:
                    state.policy.set_priority(key, priority)

    def drop_owner(self, owner: int) -> None:
        """A client went away: its leases and reservations end after ``orphan_grace_s``.

        Not at once: the client may have handed slot numbers to another process (an engine
        worker) that is still copying; a slot reused under it would be a wrong block.
        """
        now = self.clock()
        end = now + self.config.orphan_grace_s
        with self._lock:
            for record in self.leases.values():
                if record.owner == owner:
                    record.deadline = min(record.deadline, end)
            for entry in self.entries.values():
                if entry.where is Where.RESERVED and entry.owner == owner:
                    entry.deadline = min(entry.deadline, end)
        if self.config.orphan_grace_s == 0:
            self.expire(now)

    def expire(self, now: float | None = None) -> None:
        """Drop leases and reservations past their deadline (called periodically)."""
        now = self.clock() if now is None else now
        with self._lock:
            self._drop_where(lambda lease: lease.deadline <= now,
                             lambda entry: entry.deadline <= now)

    def _drop_where(self, lease_dead: Callable[[LeaseRecord], bool],
                    entry_dead: Callable[[Entry], bool]) -> None:
        for record in [r for r in self.leases.values() if lease_dead(r)]:
            del self.leases[record.lease_id]
            self._release(record)
            self.metrics.leases_expired.labels("lease").inc()
        dead = [e for e in self.entries.values()
                if e.where is Where.RESERVED and entry_dead(e)]
        for entry in dead:
            self._drop_slot(entry)
            self.metrics.leases_expired.labels("reservation").inc()
        if dead:
            self._changed.notify_all()

    def stats(self) -> dict[str, object]:
        with self._lock:
            tiers: dict[str, object] = {
                ARENA: {"slots": self.arena.num_slots, "free": self.arena.free_slots,
                        "ready": len(self.policy), "slot_bytes": self.arena.slot_bytes},
            }
            for s in self.tiers:
                tiers[s.name] = {"chunks": len(s.sizes), "used_bytes": s.used,
                                 "capacity_bytes": s.capacity, **s.tier.describe()}
            return {"tiers": tiers, "leases": len(self.leases), "entries": len(self.entries)}

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until no lower-tier write, delete or promotion is in flight. True if drained."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (any(e.writing or e.reading for e in self.entries.values())
                   or any(state.deleting for state in self.tiers)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        self._set_gauges()
        return True

    def close(self, drain_s: float = 10.0) -> None:
        """Write back what only the arena holds, finish writes in flight (up to
        ``drain_s``), stop the I/O threads, free the arena."""
        if drain_s > 0:
            self._write_back_all()
        self.flush(drain_s)
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        for state in self.tiers:
            state.close()
        self.arena.close()
        self.arena.unlink()

    def _write_back_all(self) -> None:
        with self._lock:
            for entry in list(self.entries.values()):
                if entry.where is not Where.READY:
                    continue
                targets = [t for t in self.tiers if t.write_back and self._wants(t, entry)]
                if targets:
                    self._submit_write(entry, targets)

    def check_integrity(self) -> None:
        """Raise IntegrityError if the arena, the entries, the leases and the tiers disagree."""
        with self._lock:
            self.arena.check_integrity()
            for state in self.tiers:
                state.check_integrity()
            check_entries(self)
