"""The hostile peer's bookings: records of chunks that may not exist, put in the journal.

A third party with write access to the tier's journal (no cluster secret, or with it) writes
notes of well-formed ``+`` records of a plausible size for chunks it never wrote. Each story
ends with every chunk this server wrote or verified still on the tier and served, the books
within their bounds, and their integrity check passing (docs/shared.md, "What a peer's
records may cost").
"""

from __future__ import annotations

import gc
import os
import time

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    expected,
    keys,
    load,
    sample,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.keys import ChunkKey
from kvtier.shards import EPOCH
from kvtier.store import TieredStore, journal
from kvtier.store.sharing import APPLY_BATCH
from store.test_untrusted import OLD, Servers, _fs, listed, put_journal, tier_of

FS_ONLY = pytest.mark.parametrize("backend", [pytest.param(_fs, id="fs")], indirect=True)


def applied(store: TieredStore, name: str) -> bool:
    """The reader has fetched and applied the note ``name``."""
    return name in store.sharing[store.tiers[0].name]._seen


def phantoms(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(32)) for _ in range(n)]


def refused(store: TieredStore, limit: str) -> float:
    return sample(store, "kvtier_bookings_refused_total", tier="shared", limit=limit)


def test_plausible_forged_puts_cannot_empty_the_tier(servers: Servers) -> None:
    """One note of MAX_RECORDS puts of a chunk's own size, random keys, into a tier holding
    20 chunks: the next writes here evict none of the 20 to make room for them."""
    victim = servers("v", slots=24, capacity=48 * CHUNK_BYTES)
    real = keys(20, "real")
    store_chunks(victim, real)
    settle(victim)
    assert listed(victim) == set(real)
    size = victim.tiers[0].fits_slot
    note = put_journal(victim, [["+", NS, k, size] for k in phantoms(journal.MAX_RECORDS)])
    assert wait_until(lambda: applied(victim, note), 10.0)
    more = keys(3, "more")
    store_chunks(victim, more)
    settle(victim)
    time.sleep(0.2)  # deletes queued by the writes' evictions have run
    assert set(real) <= listed(victim), "no real chunk was deleted for a phantom"
    assert set(more) <= listed(victim)
    assert all(k in victim.tiers[0] for k in real + more)
    assert load(victim, real).payloads == expected(real)
    state = victim.tiers[0]
    assert state.bookings.bytes <= state.configured, "one peer books at most the tier"
    assert refused(victim, "peer") > 0
    victim.check_integrity()


def test_a_signed_peer_cannot_evict_what_was_verified_either(servers: Servers) -> None:
    """A writer holding the cluster secret signs its phantom puts: they are a peer's word
    all the same, and cost only their own room."""
    victim = servers("v", [OLD], slots=24, capacity=48 * CHUNK_BYTES)
    real = keys(20, "real")
    store_chunks(victim, real)
    settle(victim)
    size = victim.tiers[0].fits_slot
    name = journal.note_name(int(time.time() * 1000), "e" * 16, 0)
    records = journal.encode([journal.Record("+", NS, k, size)
                              for k in phantoms(journal.MAX_RECORDS)])
    tier_of(victim).put_note(name, victim.sharing["shared"]._sign(name, records))
    assert wait_until(lambda: applied(victim, name), 10.0)
    assert victim.tiers[0].bookings.count > 0, "the signed note was applied"
    store_chunks(victim, keys(3, "more"))
    settle(victim)
    time.sleep(0.2)
    assert set(real) <= listed(victim)
    assert load(victim, real).payloads == expected(real)
    victim.check_integrity()


def test_a_phantom_is_dropped_on_its_first_miss(servers: Servers) -> None:
    victim = servers("v")
    ghost = phantoms(1)
    note = put_journal(victim, [["+", NS, ghost[0], victim.tiers[0].fits_slot]])
    assert wait_until(lambda: applied(victim, note), 5.0)
    assert victim.lookup(ghost) == ["shared"], "a peer's record is served (on its word)"
    assert load(victim, ghost).payloads in ([], [None])
    assert ghost[0] not in victim.tiers[0] and victim.tiers[0].bookings.count == 0
    victim.check_integrity()


def test_a_peer_chunk_read_here_is_verified_and_kept(servers: Servers) -> None:
    """A real chunk another server wrote becomes this server's own once read and verified:
    phantoms never push it out either."""
    writer = servers("w")
    reader = servers("r", slots=24, capacity=48 * CHUNK_BYTES)
    theirs = keys(4, "theirs")
    store_chunks(writer, theirs)
    settle(writer)
    assert wait_until(lambda: reader.lookup(theirs) == ["shared"] * 4, 5.0)
    assert reader.tiers[0].bookings.count == 4, "booked on the writer's word"
    assert load(reader, theirs).payloads == expected(theirs)
    assert reader.tiers[0].bookings.count == 0, "verified by the read"
    mine = keys(16, "mine")
    store_chunks(reader, mine)
    note = put_journal(reader, [["+", NS, k, reader.tiers[0].fits_slot]
                                for k in phantoms(journal.MAX_RECORDS)])
    assert wait_until(lambda: applied(reader, note), 10.0)
    store_chunks(reader, keys(4, "later"))
    settle(reader)
    time.sleep(0.2)
    assert set(theirs + mine) <= listed(reader)
    reader.check_integrity()
    writer.check_integrity()


def test_room_made_here_forgets_a_peer_chunk_and_never_deletes_it(servers: Servers) -> None:
    """A peer's chunks not read here yet are bookings: when this server's writes need their
    room, it forgets them (counted), and they stay on the tier for their writer; the tier's
    total is the sweeper's to keep (not sweeping here)."""
    writer = servers("w", sweep_interval_s=3600.0)
    reader = servers("r", slots=16, capacity=8 * CHUNK_BYTES, sweep_interval_s=3600.0)
    theirs = keys(4, "theirs")
    store_chunks(writer, theirs)
    settle(writer)
    assert wait_until(lambda: reader.tiers[0].bookings.count == 4, 5.0)
    mine = keys(8, "mine")
    store_chunks(reader, mine)
    settle(reader)
    time.sleep(0.2)  # deletes queued by the writes' evictions have run
    assert set(theirs) <= listed(reader), "no peer's chunk was deleted for this server's room"
    assert reader.tiers[0].bookings.count == 0 and not set(theirs) & set(reader.tiers[0].sizes)
    assert sample(reader, "kvtier_evictions_total", tier="shared", cause="booking") == 4
    reader.check_integrity()
    writer.check_integrity()


@FS_ONLY
def test_bookings_are_bounded_per_peer_and_per_tier(servers: Servers) -> None:
    """300,000 well-formed puts spread over notes under the per-note caps, from one peer
    and from many forged ones: the books keep what the bounds allow and count the rest."""
    victim = servers("v")
    state = victim.tiers[0]
    size = state.fits_slot
    per_note = journal.MAX_RECORDS - 96
    total = 300_000
    names: list[str] = []
    for n in range(0, total, per_note):  # half from one peer, half from ~37 forged ids
        server = "e" * 16 if n < total // 2 else f"{n:016x}"
        records = [["+", NS, k, size] for k in phantoms(min(per_note, total - n))]
        names.append(put_journal(victim, records, server=server, ms=int(time.time() * 1000)))
    assert wait_until(lambda: all(applied(victim, name) for name in names), 120.0)
    limits = state.bookings.limits
    assert state.bookings.count <= limits.tier_entries
    assert state.bookings.bytes <= limits.tier_bytes
    assert all(count <= limits.peer_entries for count in state.bookings.per_peer_counts())
    assert len(state.sizes) <= limits.tier_entries
    turned = refused(victim, "peer") + refused(victim, "tier")
    assert turned == total - state.bookings.count, "every record left out is counted"
    real = keys(3, "real")  # and the tier still works for this server
    store_chunks(victim, real)
    settle(victim)
    assert set(real) <= listed(victim)
    victim.check_integrity()


@FS_ONLY
def test_a_flood_of_records_leaves_nothing_for_the_garbage_collector(servers: Servers) -> None:
    """Applying notes at the caps leaves no long-lived objects the garbage collector tracks
    (a full collection walks them all, holding every thread; docs/shared.md): the books,
    the bookings and the event log hold plain values only, and the books' tables are plain
    dicts the collector does not walk (an OrderedDict would add a visit per record)."""
    victim = servers("v", capacity=1 << 30)
    size = victim.tiers[0].fits_slot
    gc.collect()
    before, walked = len(gc.get_objects()), _walked(victim)
    names = [put_journal(victim, [["+", NS, k, size] for k in phantoms(journal.MAX_RECORDS)],
                         server=f"{i:016x}") for i in range(12)]
    assert wait_until(lambda: all(applied(victim, n) for n in names), 60.0)
    assert victim.tiers[0].bookings.count == 12 * journal.MAX_RECORDS
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert grown < 1000, f"{grown} more objects tracked after {len(names)} notes"
    more = _walked(victim) - walked
    assert more < 5000, f"a full collection visits {more} more references after 49,152 records"
    assert victim.lock_cpu_max_s["journal"] < 0.05
    victim.check_integrity()


def _walked(store: TieredStore) -> int:
    """References a full collection follows: from every object the collector tracks but the
    store's event log (bounded: its last 65,536 events)."""
    log = store.events._events
    return sum(len(gc.get_referents(obj)) for obj in gc.get_objects() if obj is not log)


@FS_ONLY
def test_a_flood_is_applied_in_short_holds_that_rehash_little(servers: Servers) -> None:
    """Notes at the caps from twelve peers: each hold of the store lock applies at most
    APPLY_BATCH records, and no table of the books holds more than an epoch of keys (a
    growing dict rehashes every key it holds at once, and no other thread runs meanwhile),
    though the books hold twelve times that."""
    victim = servers("v", capacity=1 << 30)
    state = victim.tiers[0]
    size = state.fits_slot
    holds = victim.lock_holds.get("journal", 0)
    names = [put_journal(victim, [["+", NS, k, size] for k in phantoms(journal.MAX_RECORDS)],
                         server=f"{i:016x}") for i in range(12)]
    assert wait_until(lambda: all(applied(victim, n) for n in names), 60.0)
    records = 12 * journal.MAX_RECORDS
    assert state.bookings.count == records
    assert victim.lock_holds["journal"] - holds >= records // APPLY_BATCH
    assert state.largest_table() <= EPOCH < records // 10
    victim.check_integrity()


@FS_ONLY
def test_made_up_namespaces_leave_nothing_behind(servers: Servers) -> None:
    """Every record may name a namespace of its own: once the bookings are gone (the peer's
    own deletes here), nothing of them stays in memory."""
    victim = servers("v", capacity=2000 * CHUNK_BYTES)
    size = victim.tiers[0].fits_slot
    ghosts = phantoms(1000)
    spaces = [os.urandom(32) for _ in ghosts]
    put = put_journal(victim, [["+", ns, k, size] for ns, k in zip(spaces, ghosts, strict=True)])
    assert wait_until(lambda: applied(victim, put), 10.0)
    assert victim.tiers[0].bookings.count == 1000
    gone = put_journal(victim, [["-", ns, k, 0] for ns, k in zip(spaces, ghosts, strict=True)],
                       server="f" * 16)
    assert wait_until(lambda: applied(victim, gone), 10.0)
    state = victim.tiers[0]
    assert state.bookings.count == 0 and not state.sizes
    assert not set(spaces) & set(state._interned), "no made-up namespace is kept"
    victim.check_integrity()
