"""The placement core on its own: plain values in, decisions out (kvtier/store/placement.py).

The store and ``kvtier trace simulate`` both call these; tests/trace/test_trace_store_agreement.py
checks that, fed the same accesses, they end with the same tier contents.
"""

from __future__ import annotations

import ast
from collections.abc import Hashable
from pathlib import Path

import pytest

from kvtier.errors import IntegrityError
from kvtier.store import bookings, placement
from kvtier.store.placement import (
    Refusal,
    TierBooks,
    free_ahead,
    free_target,
    lower_source,
    make_slot,
    record_use,
    servable_prefix,
    servable_tiers,
    write_targets,
)


def books(capacity: int = 3, admission: tuple[tuple[str, int], ...] = (), **kw: object
          ) -> TierBooks:
    return TierBooks("disk", capacity, "lru", capacity, admission, **kw)  # type: ignore[arg-type]


def filled(tier: TierBooks, *keys: int, size: int = 1) -> TierBooks:
    for key in keys:
        assert tier.make_room(size, lambda _k: False) == []
        tier.add(key, size, promised=size)
    return tier


def never(_key: Hashable) -> bool:
    return False


def test_make_room_evicts_oldest_first_and_promises_the_room() -> None:
    tier = filled(books(3), 1, 2, 3)
    assert tier.make_room(1, never) == [1]
    assert (tier.used, tier.reserved, 1 in tier) == (2, 1, False)
    tier.add(4, 1, promised=1)
    assert tier.policy.order() == [2, 3, 4] and tier.reserved == 0
    tier.check_integrity()


def test_make_room_is_all_or_nothing_and_skips_protected_chunks() -> None:
    tier = filled(books(4), 1, 2, 3, 4)
    assert tier.make_room(2, lambda k: k in (1, 2)) == [3, 4]
    tier.release(2)
    assert tier.make_room(4, lambda k: k != 1) is None, "two must go, only chunk 1 may"
    assert tier.policy.order() == [1, 2] and (tier.used, tier.reserved) == (2, 0)
    assert tier.make_room(5, never) is None, "larger than the tier"


def test_copies_under_way_count_against_the_capacity() -> None:
    tier = filled(books(2), 1)
    assert tier.make_room(1, never) == []  # promised, not landed yet
    assert tier.make_room(1, never) == [1], "the promise takes room beside chunk 1"


def test_refusal_names_why_a_copy_may_not_start() -> None:
    up = [True]
    tier = books(10, (("after_uses", 2),), available=lambda: up[0])
    filled(tier, 1)
    tier.mark_deleting(2)
    assert tier.refusal(1, False, 35, 512) == "held"
    assert tier.refusal(2, False, 35, 512) == "held", "its delete is queued"
    assert tier.refusal(3, True, 35, 512) == "held", "a copy is under way"
    assert tier.refusal(b"k", False, 35, 512) == "policy", "used once only"
    tier.record_use(b"k")
    tier.record_use(b"k")
    assert tier.refusal(b"k", False, 35, 512) is None
    up[0] = False
    assert tier.refusal(b"k", False, 35, 512) == "breaker_open"
    tier.clear_deleting(2)
    assert tier.refusal(2, False, 35, 512) == "breaker_open"


def test_admission_sees_the_rule_key_and_the_prefix_tokens() -> None:
    tier = books(10, (("min_prefix_tokens", 1024),))
    assert tier.refusal(7, False, 35, 512, rule_key=b"\0" * 8) == "policy"
    assert tier.refusal(7, False, 35, 1024, rule_key=b"\0" * 8) is None


def test_write_targets_keeps_the_tiers_that_want_the_chunk_and_reports_the_rest() -> None:
    a, b, c = books(5), books(5, (("after_uses", 2),)), books(5)
    filled(c, 9)
    refused: list[tuple[TierBooks, Refusal]] = []
    out = write_targets([a, b, c], 9, lambda _t: False, 35, 512, rule_key=b"x",
                        refused=lambda t, why: refused.append((t, why)))
    assert out == [a] and refused == [(b, "policy"), (c, "held")]
    record_use([a, b, c], b"x")
    record_use([a, b, c], b"x")
    assert write_targets([a, b, c], 9, lambda t: t is a, 35, 512, rule_key=b"x") == [b]


def test_lower_source_is_the_first_available_tier_with_a_chunk_a_slot_takes() -> None:
    up = [True]
    small = filled(TierBooks("small", 100, "lru", 10, fits_slot=4), 1, size=8)
    first = filled(TierBooks("first", 100, "lru", 10, available=lambda: up[0]), 1, 2)
    second = filled(TierBooks("second", 100, "lru", 10), 2)
    tiers = [small, first, second]
    assert lower_source(tiers, 1) is first, "small holds it larger than a slot"
    assert lower_source(tiers, 2) is first
    up[0] = False
    assert lower_source(tiers, 2) is second and lower_source(tiers, 1) is None
    assert lower_source(tiers, 3) is None


def test_the_first_miss_ends_the_prefix() -> None:
    where = {1: "arena", 2: "disk", 4: "arena"}
    assert servable_prefix([1, 2, 3, 4], where.get) == [(1, "arena"), (2, "disk")]
    assert servable_prefix([3, 1], where.get) == []
    assert servable_tiers([1, 2, 3, 4], where.get) == ["arena", "disk"]
    assert servable_tiers([3, 1], where.get) == []


class Arena:
    """Slots and an LRU order of chunks; ``dirty`` ones are written back before they go."""

    def __init__(self, slots: int, dirty: set[int]) -> None:
        self.slots, self.dirty = slots, dirty
        self.order: list[int] = []
        self.demoting: list[int] = []

    def victim(self) -> int | None:
        return self.order.pop(0) if self.order else None

    def evict(self, key: int) -> bool:
        if key in self.dirty:
            self.demoting.append(key)
            return False
        return True

    def free(self) -> bool:
        return len(self.order) + len(self.demoting) < self.slots


def test_make_slot_takes_one_victim_per_slot_and_none_that_is_written_back_first() -> None:
    arena = Arena(2, dirty={1})
    arena.order = [2, 3]
    assert make_slot(arena.free, arena.victim, arena.evict) and arena.order == [3]
    arena.order = [1, 3]
    assert not make_slot(arena.free, arena.victim, arena.evict), "1 is written back first"
    assert arena.order == [3] and arena.demoting == [1], "and 3 stays: one victim only"
    arena = Arena(1, dirty=set())
    arena.order = [5]
    assert not make_slot(arena.free, lambda: None, arena.evict), "nothing may be evicted"


def test_free_ahead_evicts_until_the_target_is_free_or_coming_free() -> None:
    arena = Arena(4, dirty={1, 2})
    arena.order = [1, 2, 3, 4]
    target = free_target(0.5, 4, write_back=True)
    free_ahead(lambda: arena.slots - len(arena.order) < target, arena.victim, arena.evict)
    assert arena.order == [3, 4] and arena.demoting == [1, 2]
    assert free_target(0.5, 4, write_back=False) == 0, "freeing ahead pays for write-back only"


def test_check_integrity_finds_books_that_disagree() -> None:
    tier = filled(books(3), 1, 2)
    tier.check_integrity()
    tier.used += 1
    with pytest.raises(IntegrityError, match="used bytes"):
        tier.check_integrity()


def test_the_core_imports_no_runtime_piece_and_no_trace() -> None:
    """Pure: no threads, I/O, slots or lock, and nothing of its callers (store, trace)."""
    allowed = {"__future__", "collections.abc", "typing", "kvtier.errors", "kvtier.policies",
               "kvtier.store.bookings", "kvtier.shards"}
    for module in (placement, bookings):  # the books' bookings are plain data too (and a log)
        tree = ast.parse(Path(module.__file__ or "").read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        extra = imported - allowed - {"logging", "dataclasses"}
        assert not extra, f"{module.__name__} imports {sorted(extra)}"


def booked(tier: TierBooks, key: int, peer: str = "peer", size: int = 1) -> None:
    tier.add(key, size, peer=peer)


def test_room_taken_from_a_booking_forgets_it_and_never_makes_it_a_victim() -> None:
    """A booking may be its peer's verified chunk: making room forgets it (nothing to
    delete); this server's released and old chunks stay, in their retention order."""
    tier = books(3)
    tier.add("mine_released", 1, priority=0)
    tier.add("mine_old", 1, priority=35)
    booked(tier, "peer_fresh")  # type: ignore[arg-type]
    forgot: list[Hashable] = []
    assert tier.make_room(1, never, forgot) == [], "nothing of the peer's is deleted"
    assert forgot == ["peer_fresh"] and "peer_fresh" not in tier
    assert tier.bookings.count == 0 and (tier.used, tier.reserved) == (2, 1)
    tier.add("new", 1, promised=1)
    assert tier.make_room(1, never) == ["mine_released"], "then by retention, lowest first"
    tier.check_integrity()


def test_confirmed_chunks_are_victims_only_for_the_room_bookings_cannot_give() -> None:
    tier = books(4)
    tier.add("mine_released", 1, priority=0)
    tier.add("mine_old", 1, priority=35)
    booked(tier, "a")  # type: ignore[arg-type]
    booked(tier, "b")  # type: ignore[arg-type]
    forgot: list[Hashable] = []
    assert tier.make_room(3, never, forgot) == ["mine_released"]
    assert sorted(forgot) == ["a", "b"] and (tier.used, tier.reserved) == (1, 3)
    tier.check_integrity()


def test_a_booking_being_read_does_not_stop_a_confirmed_chunk_making_room() -> None:
    """A booking under a read is protected: it gives no room, so the confirmed chunks
    give it (the write is not refused)."""
    tier = books(3)
    tier.add(1, 1)
    tier.add(2, 1)
    booked(tier, 3)
    assert tier.make_room(1, lambda k: k == 3) == [1]
    assert 3 in tier and tier.bookings.count == 1
    tier.check_integrity()


def test_room_is_all_or_nothing_with_bookings_too() -> None:
    tier = books(3)
    tier.add(1, 1)
    booked(tier, 2)
    booked(tier, 3)
    forgot: list[Hashable] = []
    assert tier.make_room(3, lambda k: k == 1, forgot) is None
    assert forgot == [] and tier.policy.order() == [1, 2, 3] and tier.bookings.count == 2
    assert (tier.used, tier.reserved) == (3, 0)
    tier.check_integrity()
