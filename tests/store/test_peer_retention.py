"""A peer's retention in a shared tier's books: carried by its journal's ``+`` records, capped.

Another server retains a chunk it writes (a session that continues): its ``+`` record says so,
and every reader keeps the chunk at that priority for that long in its own books, within its
tier's caps (``max_peer_priority``, ``max_peer_retention_s``). A hostile writer of the journal
gets no more than the caps, and its retained bookings still give their room before any chunk
this server verified (docs/shared.md, "A peer's retention").
"""

from __future__ import annotations

import time

import pytest
from store_helpers import (
    CHUNK_BYTES,
    NS,
    expected,
    keys,
    load,
    settle,
    store_chunks,
    wait_until,
)

from kvtier.keys import ChunkKey
from kvtier.store import TieredStore, journal
from store.test_bookings import FS_ONLY, applied, phantoms
from store.test_untrusted import OLD, Servers, listed, put_journal, rejected, tier_of


def held(store: TieredStore, key: ChunkKey) -> tuple[int, float | None] | None:
    """The priority and seconds left of ``key`` in the shared tier's books."""
    retention = store.tiers[0].policy.retention(key)
    if retention is None:
        return None
    priority, until = retention
    return priority, None if until is None else until - store.clock()


def test_a_chunk_retained_by_its_writer_is_retained_in_every_readers_books(
        servers: Servers) -> None:
    writer = servers("w")
    reader = servers("r")
    kept, plain = keys(2, "kept"), keys(1, "plain")
    store_chunks(writer, kept, priority=70, retain_s=60.0)
    store_chunks(writer, plain)
    settle(writer)
    assert wait_until(lambda: all(k in reader.tiers[0] for k in kept + plain), 10.0)
    for key in kept:
        got = held(reader, key)
        assert got is not None and got[0] == 70
        assert got[1] is not None and 50.0 < got[1] <= 60.0, got
    assert held(reader, plain[0]) == (35, None), "no retention: the default"
    reader.check_integrity()


def test_a_retention_set_later_reaches_the_readers_head_last(servers: Servers) -> None:
    """A request's retention at finish (the writer's ``set_priority`` on chunks stored
    before) is published too; each reader keeps the chain at it, capped, and touched tail
    first, so the head is the most recent there as here. A release is not published."""
    writer = servers("w")
    reader = servers("r")
    chain = keys(3, "chain")
    store_chunks(writer, chain)
    settle(writer)
    assert wait_until(lambda: all(k in reader.tiers[0] for k in chain), 10.0)
    assert [held(reader, k) for k in chain] == [(35, None)] * 3
    writer.set_priority(chain, 90, 60.0)

    def retained() -> bool:
        return all((h := held(reader, k)) is not None and h[0] == 80 for k in chain)

    assert wait_until(retained, 10.0), [held(reader, k) for k in chain]
    for key in chain:
        got = held(reader, key)
        assert got is not None and got[1] is not None and 50.0 < got[1] <= 60.0, got
    assert reader.tiers[0].policy.order()[-3:] == chain[::-1], "the head is the most recent"
    writer.set_priority(chain, 0)
    time.sleep(0.5)  # a few journal rounds: nothing lowers the reader's books
    assert all((h := held(reader, k)) is not None and h[0] == 80 for k in chain)
    reader.check_integrity()
    writer.check_integrity()


@FS_ONLY
def test_a_hostile_peers_retention_is_capped_by_this_tier(servers: Servers) -> None:
    """Priority 100 for 1e9 s, and 'until changed', become the tier's caps."""
    reader = servers("r", max_peer_priority=60, max_peer_retention_s=5.0)
    size = reader.tiers[0].fits_slot
    ghosts = phantoms(3)
    note = put_journal(reader, [["+", NS, ghosts[0], size, 100, 1e9],
                                ["+", NS, ghosts[1], size, 100, None],
                                ["+", NS, ghosts[2], size, 50, 2.0]])
    assert wait_until(lambda: applied(reader, note), 10.0)
    for key in ghosts[:2]:
        got = held(reader, key)
        assert got is not None and got[0] == 60, got
        assert got[1] is not None and 3.0 < got[1] <= 5.0, got
    got = held(reader, ghosts[2])
    assert got is not None and got[0] == 50 and got[1] is not None and got[1] <= 2.0
    reader.check_integrity()


@FS_ONLY
def test_retention_run_out_before_the_note_is_read_is_none(servers: Servers) -> None:
    reader = servers("r")
    size = reader.tiers[0].fits_slot
    ghost = phantoms(1)
    note = put_journal(reader, [["+", NS, ghost[0], size, 90, 5.0]],
                       ms=int(time.time() * 1000) - 10_000)
    assert wait_until(lambda: applied(reader, note), 10.0)
    assert held(reader, ghost[0]) == (35, None), "10 s old, retained for 5: run out"


@FS_ONLY
def test_malformed_retention_drops_the_record_and_old_records_still_parse(
        servers: Servers) -> None:
    reader = servers("r")
    size = reader.tiers[0].fits_slot
    bad = phantoms(5)
    old = phantoms(1)
    note = put_journal(reader, [["+", NS, bad[0], size, 101, 1.0],
                                ["+", NS, bad[1], size, -1, 1.0],
                                ["+", NS, bad[2], size, 50, float("nan")],
                                ["+", NS, bad[3], size, 50, -3.0],
                                ["+", NS, bad[4], size, None, 3.0],
                                ["+", NS, old[0], size]])
    assert wait_until(lambda: applied(reader, note), 10.0)
    assert not any(k in reader.tiers[0] for k in bad)
    assert rejected(reader, "journal_record") == 5
    assert held(reader, old[0]) == (35, None)
    reader.check_integrity()


def test_retained_phantoms_cannot_evict_what_was_verified(servers: Servers) -> None:
    """A note of MAX_RECORDS puts at priority 100 for a day: the writes here still take
    their room from those bookings, never from the 20 chunks written here."""
    victim = servers("v", slots=24, capacity=48 * CHUNK_BYTES)
    real = keys(20, "real")
    store_chunks(victim, real)
    settle(victim)
    size = victim.tiers[0].fits_slot
    note = put_journal(victim, [["+", NS, k, size, 100, 86_400.0]
                                for k in phantoms(journal.MAX_RECORDS)])
    assert wait_until(lambda: applied(victim, note), 10.0)
    assert victim.tiers[0].bookings.count > 0
    more = keys(3, "more")
    store_chunks(victim, more)
    settle(victim)
    time.sleep(0.2)  # deletes queued by the writes' evictions have run
    assert set(real + more) <= listed(victim)
    assert load(victim, real).payloads == expected(real)
    victim.check_integrity()


def test_a_retention_here_does_not_vouch_for_a_peers_unverified_bookings(
        servers: Servers) -> None:
    """A chain retained here that holds chunks only booked on a peer's word (never read
    here) publishes the retention of the chunks this server holds, not of the bookings: a
    hostile peer's claims are not passed on under this server's name."""
    reader = servers("r")
    other = servers("o")
    real = keys(2, "real")
    store_chunks(reader, real)
    settle(reader)
    size = reader.tiers[0].fits_slot
    booked = phantoms(2)
    note = put_journal(reader, [["+", NS, k, size] for k in booked])
    assert wait_until(lambda: applied(reader, note) and applied(other, note), 10.0)
    assert all(k in reader.tiers[0].bookings for k in booked)
    reader.set_priority(real + booked, 70, 60.0)

    def retained() -> bool:
        return all((h := held(other, k)) is not None and h[0] == 70 for k in real)

    assert wait_until(retained, 10.0), [held(other, k) for k in real]
    time.sleep(0.3)  # a few more journal rounds
    assert [held(other, k) for k in booked] == [(35, None)] * 2, "the bookings stay the peer's"
    assert all(other.tiers[0].bookings.peer_of.get(k) == "e" * 16 for k in booked)
    assert all((h := held(reader, k)) is not None and h[0] == 70 for k in booked), \
        "kept here all the same"


def test_a_booking_retained_here_is_announced_once_read_and_verified(
        servers: Servers) -> None:
    """The writer's chunks are bookings in the reader's books. The reader retains them: not
    published while they are bookings; once it reads and verifies them, its retention is
    published, and a third server keeps them so."""
    writer = servers("w")
    reader = servers("r")
    other = servers("o")
    chain = keys(2, "chain")
    store_chunks(writer, chain)
    settle(writer)
    assert wait_until(lambda: all(k in reader.tiers[0].bookings and k in other.tiers[0]
                                  for k in chain), 10.0)
    reader.set_priority(chain, 70, 60.0)
    time.sleep(0.3)  # a few journal rounds
    assert [held(other, k) for k in chain] == [(35, None)] * 2, "not while booked"
    assert load(reader, chain).payloads == expected(chain)
    assert not any(k in reader.tiers[0].bookings for k in chain)

    def retained() -> bool:
        return all((h := held(other, k)) is not None and h[0] == 70 for k in chain)

    assert wait_until(retained, 10.0), [held(other, k) for k in chain]
    reader.check_integrity()


@FS_ONLY
def test_the_note_mac_covers_the_retention(servers: Servers) -> None:
    """A signed note whose retention was changed after signing is refused whole."""
    reader = servers("r", [OLD])
    size = reader.tiers[0].fits_slot
    honest, forged = phantoms(1), phantoms(1)
    sharing = reader.sharing["shared"]
    name = journal.note_name(int(time.time() * 1000), "e" * 16, 0)
    data = journal.encode([journal.Record("+", NS, honest[0], size, 40, 30.0)])
    tier_of(reader).put_note(name, sharing._sign(name, data))
    name2 = journal.note_name(int(time.time() * 1000), "e" * 16, 1)
    signed = journal.encode([journal.Record("+", NS, forged[0], size, 40, 30.0)])
    tampered = journal.encode([journal.Record("+", NS, forged[0], size, 80, 30.0)])
    assert len(signed) == len(tampered)
    blob = sharing._sign(name2, signed)
    tier_of(reader).put_note(name2, blob[: len(blob) - len(signed)] + tampered)
    assert wait_until(lambda: applied(reader, name) and applied(reader, name2), 10.0)
    got = held(reader, honest[0])
    assert got is not None and got[0] == 40
    assert forged[0] not in reader.tiers[0], "the tampered note was refused"
    reader.check_integrity()


@pytest.mark.parametrize("options", [{"max_peer_priority": 101},
                                     {"max_peer_retention_s": 0},
                                     {"max_peer_retention_s": 1e9}])
def test_caps_out_of_range_are_refused(options: dict[str, float]) -> None:
    from kvtier.errors import ConfigError
    from kvtier.tiers.shared import SharingOptions

    with pytest.raises(ConfigError, match=next(iter(options))):
        SharingOptions(**options)  # type: ignore[arg-type]
