"""The sweep of a shared tier: budgets kept, leftovers of others cleaned.

Exactly one server sweeps at a time: the one with the smallest id among those whose
heartbeat (``servers/<id>`` notes, written every ``HEARTBEAT_S``) is fresh. A sweep:

1. lists each namespace (its usage is what the listing says, whoever wrote it) and deletes
   the oldest chunks of any namespace over ``namespace_bytes`` until it is at ``LOW_WATER`` of
   it; recency is the backend's modification time, which every server's hits refresh
   (``touch``, at most once per ``touch_interval_s`` per chunk per server), so "oldest" means
   least recently written or used by anyone; a chunk the sweeping server's books hold at a
   retention priority (its own, or a peer's from the journal, capped) goes after every chunk
   of a lower priority, as in a server's own eviction;
2. does the same for the whole tier against ``capacity_bytes``;
3. deletes journal notes older than ``journal_keep_s``, heartbeats of servers gone for an
   hour, and temporary objects of writers killed more than ``stale_temp_s`` ago.

What peers wrote is untrusted (docs/security.md): a heartbeat or note dated more than
``max_clock_skew_s`` ahead of this server's clock takes no part in the election and is deleted,
as are journal names that do not parse and heartbeats that do not decode (or, with a cluster
secret, are not signed with it); a chunk of a size no slot here can hold (``plausible``) goes
first when a budget is over, and a modification time further ahead than the skew counts
as now plus the skew (a chunk dated far ahead is not kept forever).

``kvtier gc`` runs the same function (``dry_run`` lists what would go). A chunk deleted under
a reader is a miss for that reader, never wrong bytes: every read is verified.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvtier.auth import Keyring, NoteRefusal
from kvtier.errors import NoteTooLarge
from kvtier.keys import ChunkKey
from kvtier.store import journal
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.shared import SharedTier

HEARTBEAT_BYTES = 4096

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
          now: float | None = None, plausible: Callable[[int], bool] = lambda _s: True,
          keyring: Keyring | None = None,
          priority: Callable[[ChunkKey], int] | None = None) -> SweepReport:
    """One sweep (see the module docstring). ``keep`` protects chunks this server is
    reading; ``deleted`` is told each batch that was removed (to journal it); ``priority``:
    each chunk's retention priority in this server's books (None: all the default)."""
    now = time.time() if now is None else now
    opts = tier.sharing

    latest = now + opts.max_clock_skew_s

    def order(chunk: StoredChunk) -> tuple[bool, int, float]:
        # implausible first, then the lowest priority, then the oldest
        return (plausible(chunk.size), priority(chunk.key) if priority is not None else 0,
                min(chunk.mtime, latest))

    report = SweepReport()
    survivors: list[StoredChunk] = []
    for namespace in tier.namespaces():
        chunks = sorted(tier.scan_namespace(namespace), key=order)
        used = sum(c.size for c in chunks)
        report.usage[namespace], report.chunks[namespace] = used, len(chunks)
        budget = opts.namespace_bytes if opts.namespace_bytes is not None else capacity
        chunks = _trim(tier, chunks, used, budget, dry_run, keep, deleted, report)
        survivors += chunks
    survivors.sort(key=order)
    _trim(tier, survivors, sum(c.size for c in survivors), capacity, dry_run, keep, deleted,
          report)
    if not dry_run:
        report.notes_deleted = _old_notes(tier, now, opts.journal_keep_s,
                                          opts.max_clock_skew_s, keyring)
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


def _old_notes(tier: SharedTier, now: float, keep_s: float, skew_s: float,
               keyring: Keyring | None) -> int:
    """Delete journal notes too old, dated in the future or badly named, and heartbeats of
    servers long gone, dated in the future, or that do not decode."""
    cutoff_ms, ahead_ms = int((now - keep_s) * 1000), int((now + skew_s) * 1000)
    doomed = []
    for name in tier.iter_notes(journal.PREFIX):
        parsed = journal.parse_name(name)
        if parsed is None or not cutoff_ms <= parsed[0] <= ahead_ms:
            doomed.append(name)
    beats = read_heartbeats(tier, keyring)
    doomed += [f"{SERVERS}{server}" for server, beat in beats.items()
               if beat is None or not now - GONE_S <= beat <= now + skew_s]
    for name in doomed:
        tier.delete_note(name)
    return len(doomed)


def read_heartbeats(tier: SharedTier, keyring: Keyring | None = None
                    ) -> dict[str, float | None]:
    """Each server's last heartbeat (wall clock seconds) by server id; ``None`` for one
    that is too large, does not decode or (with a keyring) is not signed with it."""
    out: dict[str, float | None] = {}
    for name in tier.list_notes(SERVERS):
        try:
            data = tier.get_note(name, HEARTBEAT_BYTES)
        except NoteTooLarge:
            data = b""
        if data is None:  # deleted meanwhile
            continue
        if keyring is not None:
            opened = keyring.open_note(tier.note_scope, name, data)
            data = b"" if isinstance(opened, NoteRefusal) else opened
        try:
            beat = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            beat = None
        t = beat.get("t") if isinstance(beat, dict) else None
        ok = isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t)
        out[name.removeprefix(SERVERS)] = float(t) if ok else None  # type: ignore[arg-type]
    return out


def heartbeats(tier: SharedTier, keyring: Keyring | None = None) -> dict[str, float]:
    """Each server's last valid heartbeat (wall clock seconds), by server id."""
    return {server: beat for server, beat in read_heartbeats(tier, keyring).items()
            if beat is not None}


def sweeper_of(tier: SharedTier, now: float, keyring: Keyring | None = None,
               skew_s: float = journal.SKEW_S) -> str | None:
    """The server that sweeps now: the smallest id with a fresh heartbeat; one dated more
    than ``skew_s`` ahead of ``now`` is not fresh (a wrong or forged clock wins nothing)."""
    fresh = [server for server, beat in heartbeats(tier, keyring).items()
             if now - 3 * HEARTBEAT_S <= beat <= now + skew_s]
    return min(fresh) if fresh else None
