"""The arena's books: its slots, the chunk in each, and their eviction order.

One :class:`~kvtier.store.records.Entry` per chunk holding a slot; a chunk enters with
:meth:`ArenaIndex.take` (RESERVED or PROMOTING), becomes servable with :meth:`publish` (or
:meth:`promoted`) and leaves with :meth:`drop` (which frees the slot). Every change of an
entry is a method here: the copies below it (:meth:`start_write`, :meth:`end_write`), its
demotion (:meth:`start_demotion`, :meth:`rescue`, :meth:`end_demotion`), its read from a
lower tier (:meth:`promoting`, :meth:`promoted`) and its header page (:meth:`seal`).
Slots of entries that are leased, being written below or being promoted are protected: the
eviction order never names them::

    entries[key].slot ◄──► arena slot (WRITING or READY)      one to one
    READY or PROMOTING entries ────► eviction policy           unless demoting
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

from kvtier.auth import Keyring
from kvtier.codec import seal
from kvtier.config import ArenaConfig
from kvtier.errors import IntegrityError
from kvtier.keys import ChunkKey
from kvtier.policies import DEFAULT_PRIORITY, EvictionPolicy, effective, make_eviction
from kvtier.store.events import REMOVED, STORED, EventLog
from kvtier.store.records import Entry, Where
from kvtier.tiers.arena import Arena

log = logging.getLogger("kvtier.store")
SEAL_LOCKS = [threading.Lock() for _ in range(64)]
"""Sealing runs on I/O threads, outside the store lock: one seal per slot at a time."""


class ArenaIndex:
    def __init__(self, config: ArenaConfig, name: str, events: EventLog | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.arena = Arena(name, config.num_slots, config.slot_bytes, prefault=config.prefault)
        self.clock = clock
        self.policy: EvictionPolicy[Hashable] = make_eviction(config.eviction, config.num_slots,
                                                              clock)
        self.entries: dict[ChunkKey, Entry] = {}
        self.events = events

    def get(self, key: ChunkKey) -> Entry | None:
        return self.entries.get(key)

    def take(self, key: ChunkKey, where: Where, priority: int,
             until: float | None = None) -> Entry | None:
        """A free slot for ``key`` (not yet in the arena), or ``None`` when none is free."""
        if key in self.entries:
            raise IntegrityError(f"chunk {key.hex()[:16]} already holds a slot")
        slot = self.arena.alloc()
        if slot is None:
            return None
        entry = Entry(key, slot, where, priority, until)
        self.entries[key] = entry
        return entry

    def join_order(self, entry: Entry) -> None:
        """Track ``entry`` in the eviction order (a promotion joins it at lease time)."""
        self.policy.insert(entry.key, entry.priority, until=entry.until)

    def publish(self, entry: Entry, parent: ChunkKey | None = None) -> None:
        """The slot's payload is complete: the chunk is servable (and evictable). ``parent``:
        the chunk before it in its prefix chain, when the caller knows it (policy hint)."""
        if entry.key not in self.policy:
            # first: it may raise, publish not
            self.policy.insert(entry.key, entry.priority, parent, entry.until)
        self.arena.publish(entry.slot)
        entry.where = Where.READY
        if self.events is not None:
            self.events.add(STORED, "arena", entry.namespace_fp, entry.key)

    def describe(self, entry: Entry, namespace_fp: bytes, tokens: int, payload_len: int,
                 prefix_tokens: int) -> None:
        """What a reserved slot will hold (the header :meth:`seal` writes, admission's view)."""
        entry.namespace_fp, entry.tokens, entry.payload_len = namespace_fp, tokens, payload_len
        entry.prefix_tokens = prefix_tokens

    def promoting(self, entry: Entry, tier: str) -> None:
        """``entry`` (a fresh PROMOTING slot) is read from ``tier``."""
        entry.reading = tier

    def promoted(self, entry: Entry, namespace_fp: bytes, tokens: int, payload_len: int
                 ) -> None:
        """The read from below ended with a verified chunk (its header says what it is):
        the chunk is servable, its slot already sealed."""
        entry.reading = None
        entry.namespace_fp, entry.tokens = namespace_fp, tokens
        entry.payload_len, entry.sealed = payload_len, True
        self.publish(entry)  # already in the eviction order since its lease

    def start_write(self, entry: Entry, tier: str) -> None:
        """A copy of the slot to ``tier`` begins: the slot stays put until it ends."""
        entry.writing.add(tier)

    def end_write(self, entry: Entry, tier: str) -> None:
        entry.writing.discard(tier)

    def start_demotion(self, entry: Entry) -> None:
        """``entry`` left the eviction order to be written back; its slot is freed when the
        last write ends (:meth:`end_demotion`)."""
        entry.demoting = True

    def rescue(self, entry: Entry) -> None:
        """A use while demoting: the chunk rejoins the eviction order when its writes end."""
        entry.rescued = entry.rescued or entry.demoting

    def end_demotion(self, entry: Entry) -> None:
        """The write-back ended: a chunk leased or used meanwhile stays, hot again; any
        other leaves the arena."""
        entry.demoting = False
        if self.arena.leases[entry.slot] or entry.rescued:
            entry.rescued = False
            self.join_order(entry)
        else:
            self.drop(entry)

    def seal(self, entry: Entry, view: memoryview, keyring: Keyring | None) -> bool:
        """Write the header page of ``entry``'s slot (once); False if a field is bad (that
        write fails; the entry is not stranded). Runs on I/O threads."""
        with SEAL_LOCKS[entry.slot % len(SEAL_LOCKS)]:
            if entry.sealed:
                return True
            try:
                seal(view, entry.namespace_fp, entry.key, entry.tokens, entry.payload_len,
                     self.lasting_priority(entry), keyring)
            except Exception:  # a bad field must fail this write, not strand the entry
                log.exception("cannot seal chunk %s", entry.key.hex()[:16])
                return False
            entry.sealed = True
            return True

    def drop(self, entry: Entry) -> None:
        """The chunk leaves the arena; its slot is free again."""
        self.arena.free(entry.slot)  # first: it refuses a leased slot
        self.policy.remove(entry.key)
        del self.entries[entry.key]
        if self.events is not None and entry.where is Where.READY:
            self.events.add(REMOVED, "arena", entry.namespace_fp, entry.key)

    def pin(self, entry: Entry) -> None:
        self.arena.lease(entry.slot)

    def unpin(self, slot: int) -> None:
        self.arena.unlease(slot)

    def victim(self) -> Entry | None:
        """The chunk the eviction order gives up next (it leaves the order), or ``None``."""
        victims = self.policy.evict(1, self._protected)
        return self.entries[victims[0]] if victims else None  # type: ignore[index]

    def _protected(self, key: Hashable) -> bool:
        entry = self.entries[key]  # type: ignore[index]
        return (bool(self.arena.leases[entry.slot]) or bool(entry.writing)
                or entry.where is not Where.READY)

    def touch(self, key: ChunkKey) -> None:
        self.policy.touch(key)  # a demoting chunk is not in the order: the use is not kept

    def set_priorities(self, keys: Sequence[ChunkKey], priority: int,
                       until: float | None = None) -> None:
        """Re-prioritise the chunks of ``keys`` held here (a prefix chain, head first) until
        ``until``; the chain keeps its order (:meth:`EvictionPolicy.set_priorities`)."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None:
                entry.priority, entry.until = priority, until
        self.policy.set_priorities(keys, priority, until)

    def retention(self, entry: Entry) -> tuple[int, float | None]:
        """``entry``'s priority now (the default past its deadline) and its deadline: what
        a copy below takes with it."""
        return effective(entry.priority, entry.until, self.clock())

    def pinned(self, key: Hashable) -> bool:
        """Whether ``key`` is held here above the default priority now."""
        entry = self.entries.get(key)  # type: ignore[call-overload]
        return entry is not None and self.retention(entry)[0] > DEFAULT_PRIORITY

    def lasting_priority(self, entry: Entry) -> int:
        """The priority a chunk's header keeps (read back by a listing after a restart):
        a timed one is not kept past its time, so the header says the default."""
        priority, until = self.retention(entry)
        return DEFAULT_PRIORITY if until is not None else priority

    def ready(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if e.where is Where.READY)

    @property
    def free_slots(self) -> int:
        return self.arena.free_slots

    def check_integrity(self) -> None:
        self.arena.check_integrity()
        slots: set[int] = set()
        for key, e in self.entries.items():
            if e.slot in slots:
                raise IntegrityError(f"slot {e.slot} belongs to two chunks")
            slots.add(e.slot)
            in_order = e.where is not Where.RESERVED and not e.demoting
            if in_order != (key in self.policy):
                raise IntegrityError(f"entry {key.hex()[:16]} ({e.where.value}) and the "
                                     "arena's eviction order disagree")
            if e.demoting and not e.writing:
                raise IntegrityError(f"entry {key.hex()[:16]} is demoting with no write")
            if (e.where is Where.PROMOTING) != (e.reading is not None):
                raise IntegrityError(f"entry {key.hex()[:16]}: promotion state is off")
        if len(self.policy) != sum(1 for k in self.entries if k in self.policy):
            raise IntegrityError("the arena's eviction order names chunks without a slot")
        busy = self.arena.num_slots - self.arena.free_slots
        if busy != len(slots):
            raise IntegrityError(f"{busy} slots in use but {len(slots)} owned by chunks")
