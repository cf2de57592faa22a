"""The sweep of a shared tier: budgets kept, leftovers of others cleaned.

Exactly one server sweeps at a time: the one with the smallest id among those whose
heartbeat (``servers/<id>`` notes, written every ``HEARTBEAT_S``) is fresh. A sweep:

1. lists each namespace (its usage is what the listing says, whoever wrote it) and deletes
   the oldest chunks of any namespace over ``namespace_bytes`` until it is at ``LOW_WATER`` of
   it; recency is the backend's modification time, which every server's hits refresh
   (``touch``, at most once per ``touch_interval_s`` per chunk per server), so "oldest" means
   least recently written or used by anyone;
2. does the same for the whole tier against ``capacity_bytes``;
3. deletes journal notes older than ``journal_keep_s``, heartbeats of servers gone for an
   hour, and temporary objects of writers killed more than ``stale_temp_s`` ago.

``kvtier gc`` runs the same function (``dry_run`` lists what would go). A chunk deleted under
a reader is a miss for that reader, never wrong bytes: every read is verified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvtier.keys import ChunkKey
from kvtier.store import journal
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.shared import SharedTier

log = logging.getLogger("kvtier.store")
LOW_WATER = 0.9
HEARTBEAT_S = 5.0
SERVERS = "servers/"
GONE_S = 3600.0


@dataclass
class SweepReport:
    usage: dict[bytes, int] = field(default_factory=dict)
    """Bytes per namespace before the sweep."""
    chunks: dict[bytes, int] = field(default_factory=dict)
    deleted: list[StoredChunk] = field(default_factory=list)
    notes_deleted: int = 0
    temps_deleted: int = 0

    @property
    def deleted_bytes(self) -> int:
        return sum(c.size for c in self.deleted)


def sweep(tier: SharedTier, capacity: int, *, dry_run: bool = False,
          keep: Callable[[ChunkKey], bool] = lambda _k: False,
          deleted: Callable[[list[StoredChunk]], None] = lambda _c: None,
          now: float | None = None) -> SweepReport:
    """One sweep (see the module docstring). ``keep`` protects chunks this server is
    reading; ``deleted`` is told each batch that was removed (to journal it)."""
    now = time.time() if now is None else now
    opts = tier.sharing
    report = SweepReport()
    survivors: list[StoredChunk] = []
    for namespace in tier.namespaces():
        chunks = sorted(tier.scan_namespace(namespace), key=lambda c: c.mtime)
        used = sum(c.size for c in chunks)
        report.usage[namespace], report.chunks[namespace] = used, len(chunks)
        budget = opts.namespace_bytes if opts.namespace_bytes is not None else capacity
        chunks = _trim(tier, chunks, used, budget, dry_run, keep, deleted, report)
        survivors += chunks
    survivors.sort(key=lambda c: c.mtime)
    _trim(tier, survivors, sum(c.size for c in survivors), capacity, dry_run, keep, deleted,
          report)
    if not dry_run:
        report.notes_deleted = _old_notes(tier, now, opts.journal_keep_s)
        report.temps_deleted = tier.clean_stale_temps(opts.stale_temp_s)
    return report


def _trim(tier: SharedTier, oldest_first: list[StoredChunk], used: int, budget: int,
          dry_run: bool, keep: Callable[[ChunkKey], bool],
          deleted: Callable[[list[StoredChunk]], None], report: SweepReport
          ) -> list[StoredChunk]:
    """Delete the oldest until ``used`` is at LOW_WATER of ``budget``; returns the rest."""
    if used <= budget:
        return oldest_first
    target = int(budget * LOW_WATER)
    gone: list[StoredChunk] = []
    rest: list[StoredChunk] = []
    for chunk in oldest_first:
        if used > target and not keep(chunk.key):
            if not dry_run:
                tier.delete(chunk.key, namespace=chunk.namespace)
            gone.append(chunk)
            used -= chunk.size
            if len(gone) % 256 == 0:
                deleted(gone[-256:])
        else:
            rest.append(chunk)
    if len(gone) % 256:
        deleted(gone[-(len(gone) % 256):])
    report.deleted += gone
    return rest


def _old_notes(tier: SharedTier, now: float, keep_s: float) -> int:
    count = 0
    cutoff_ms = int((now - keep_s) * 1000)
    for name in tier.list_notes(journal.PREFIX):
        parsed = journal.parse_name(name)
        if parsed is not None and parsed[0] < cutoff_ms:
            tier.delete_note(name)
            count += 1
    for name, beat in heartbeats(tier).items():
        if beat < now - GONE_S:
            tier.delete_note(f"{SERVERS}{name}")
            count += 1
    return count


def heartbeats(tier: SharedTier) -> dict[str, float]:
    """Each server's last heartbeat (wall clock seconds), by server id."""
    out: dict[str, float] = {}
    for name in tier.list_notes(SERVERS):
        data = tier.get_note(name)
        try:
            beat = msgspec.msgpack.decode(data) if data is not None else None
        except msgspec.DecodeError:
            beat = None
        if isinstance(beat, dict) and isinstance(beat.get("t"), int | float):
            out[name.removeprefix(SERVERS)] = float(beat["t"])
    return out


def sweeper_of(tier: SharedTier, now: float) -> str | None:
    """The server that sweeps now: the smallest id with a fresh heartbeat."""
    fresh = [server for server, beat in heartbeats(tier).items()
             if beat >= now - 3 * HEARTBEAT_S]
    return min(fresh) if fresh else None
