"""Retention quotas in the store: a tenant pins at most its bytes per tier, and its surplus
never evicts another tenant's retained chunks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from store_helpers import (
    CHUNK_BYTES,
    SLOT_BYTES,
    MakeStore,
    expected,
    keys,
    load,
    sample,
    store_chunks,
)

from kvtier.config import QuotaConfig, ServerConfig
from kvtier.errors import ConfigError
from kvtier.metrics import StoreMetrics
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.store import TieredStore
from kvtier.store.quotas import SCAN_MAX, Quotas

QUOTAS = {"tenants": {"alice": {"arena": 2 * SLOT_BYTES, "disk": 2 * CHUNK_BYTES},
                      "bob": {"arena": 6 * SLOT_BYTES, "disk": 6 * CHUNK_BYTES}},
          "others": {"arena": 0, "disk": 0}}


def pinned(store: TieredStore, chain: list[bytes], tier: str = "arena") -> int:
    """How many of ``chain`` the tier holds above the default priority."""
    policy = store.index.policy if tier == "arena" else store.tiers_by_name[tier].policy
    return sum(1 for k in chain if (r := policy.retention(k)) and r[0] > DEFAULT_PRIORITY)


def held(store: TieredStore, chain: list[bytes]) -> int:
    return sum(store.lookup([k]) == ["arena"] for k in chain)


@pytest.mark.parametrize("quotas", [QUOTAS, None], ids=["quotas", "no quotas"])
def test_a_tenant_over_its_quota_cannot_evict_another_tenants_retained_chunks(
        tmp_path: Path, make_store: MakeStore, quotas: dict[str, object] | None) -> None:
    """Scenario: Bob retains 6 chunks at 80, within his quota; Alice asks 100 for 24 chunks
    (at store and again after), far over hers, then plain traffic churns the arena. With
    quotas, every one of Bob's chunks stays, in the arena and on disk, and Alice pins no more
    than hers; without, Alice's surplus at 100 pushes Bob's out (what the quota prevents)."""
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES, retention_quotas=quotas)
    bob = keys(6, "bob")
    store_chunks(store, bob, priority=80, tenant="bob")
    store.flush(5.0)
    alice = keys(24, "alice")
    for i in range(0, 24, 4):
        store_chunks(store, alice[i:i + 4], priority=100, first_index=i, tenant="alice")
        store.set_priority(alice[:i + 4], 100, keep_stronger=True, tenant="alice")
        store.flush(5.0)
    for n in range(20):
        store_chunks(store, keys(2, f"plain{n}"), tenant="carol")
        store.flush(5.0)  # a slot being written to disk is not a victim yet
    if quotas is None:
        assert held(store, bob) < len(bob)
        return
    assert held(store, bob) == len(bob) and pinned(store, bob) == len(bob)
    assert pinned(store, bob, "disk") == len(bob)
    assert pinned(store, alice) <= 2 and pinned(store, alice, "disk") <= 2
    assert sample(store, "kvtier_retention_quota_clipped_chunks_total", tier="arena") > 0
    assert sample(store, "kvtier_retention_quota_clipped_chunks_total", tier="disk") > 0
    store.check_integrity()


def test_a_quota_frees_up_when_pinned_chunks_leave_or_are_released(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Alice's quota of 2 is full; she releases her pins, and her next 2 fit again. Tenants
    not named (or naming none) share ``others``, here 0: nothing of theirs is pinned."""
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES, retention_quotas=QUOTAS)
    first = keys(2, "first")
    store_chunks(store, first, priority=90, tenant="alice")
    second = keys(2, "second")
    store_chunks(store, second, priority=90, tenant="alice")
    assert pinned(store, first) == 2 and pinned(store, second) == 0
    store.set_priority(first, 0, tenant="alice")  # a release
    store.set_priority(second, 90, tenant="alice")
    assert pinned(store, second) == 2
    for tenant in ("mallory", None):
        stray = keys(2, f"stray-{tenant}")
        store_chunks(store, stray, priority=90, tenant=tenant)
        assert pinned(store, stray) == 0
    assert store.quotas.used("alice", "arena") == 2 * SLOT_BYTES
    assert sample(store, "kvtier_retention_quota_used_bytes", tenant="alice",
                  tier="arena") == 2 * SLOT_BYTES
    assert sample(store, "kvtier_retention_quota_bytes", tenant="bob",
                  tier="disk") == 6 * CHUNK_BYTES
    store.check_integrity()


def test_quota_config_is_checked(tmp_path: Path) -> None:
    for quotas, word in (({"tenants": {"a": {"ssd": "1GiB"}}}, "unknown tier"),
                         ({"tenants": {"a": {"arena": "lots"}}}, "tenants.a.arena"),
                         ({"others": {"arena": -1}}, "others.arena"),
                         ({"tenant": {}}, "tenant")):
        with pytest.raises(ConfigError, match=word):
            ServerConfig.from_dict({"retention_quotas": quotas})


def test_quotas_beyond_a_tier_are_allowed_and_warned_of(
        tmp_path: Path, make_store: MakeStore, caplog: pytest.LogCaptureFixture) -> None:
    """A quota larger than its tier (pods sized differently share one config) and quotas
    that add up to more than a tier (tenants rarely pin at once) start, with a warning
    each, naming the tier: there the isolation between tenants' retained chunks no longer
    holds. The arena holds its whole slots, not its size."""
    quotas = {"tenants": {"alice": {"arena": 8 * SLOT_BYTES, "disk": 41 * CHUNK_BYTES},
                          "bob": {"arena": 8 * SLOT_BYTES}},
              "others": {"arena": 0}}
    with caplog.at_level(logging.WARNING, logger="kvtier.store"):
        store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                           retention_quotas=quotas)
    said = sorted(r.getMessage() for r in caplog.records if "retention_quotas" in r.getMessage())
    assert len(said) == 3, said
    assert said[0].startswith(f"retention_quotas: alice.disk is {41 * CHUNK_BYTES} bytes, "
                              f"more than the tier holds ({40 * CHUNK_BYTES} bytes)"), said
    assert said[1].startswith(f"retention_quotas: the quotas in tier arena add up to "
                              f"{16 * SLOT_BYTES} bytes, more than it holds "
                              f"({12 * SLOT_BYTES})"), said
    assert "tier disk add up to" in said[2], said
    store.check_integrity()
    odd = ServerConfig.from_dict({"arena": {"size_bytes": 3 * SLOT_BYTES - 1,
                                            "slot_bytes": SLOT_BYTES}})
    assert odd.capacities()["arena"] == 2 * SLOT_BYTES, "whole slots"


@pytest.mark.parametrize("quotas", [
    {"tenants": {"alice": {"disk": 2 * CHUNK_BYTES}}, "others": {"arena": 0, "disk": 0}},
    {"tenants": {"alice": {"disk": 2 * CHUNK_BYTES}}, "others": {"arena": 0}},
    {"tenants": {"alice": {"arena": 12 * SLOT_BYTES, "disk": 2 * CHUNK_BYTES}},
     "others": {"arena": 0, "disk": 0}},
], ids=["alice-disk-only", "others-disk-unlimited", "alice-both"])
def test_a_restart_gives_no_tenant_a_new_quota(tmp_path: Path, make_store: MakeStore,
                                               quotas: dict[str, object]) -> None:
    """Alice pins 8 chunks with room for 2 on disk; the store restarts and lists the disk.
    The 6 clipped chunks (whose headers may say 100) do not come back pinned, whoever's
    quota would have to count them, and restarting again grants nothing more."""
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas)
    alice = keys(8, "alice")
    store_chunks(store, alice, priority=100, tenant="alice")
    store.flush(5.0)
    assert pinned(store, alice, "disk") <= 2
    store.close(drain_s=5)
    for _ in range(2):
        again = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                           retention_quotas=quotas)
        assert again.rebuild() == len(alice)
        assert pinned(again, alice, "disk") <= 2
        again.check_integrity()
        again.close(drain_s=5)


def test_a_restart_keeps_the_pins_listed_in_a_tier_without_quotas(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Quotas only in the arena: the disk's pins come back as listed after a restart."""
    quotas = {"tenants": {"alice": {"arena": 12 * SLOT_BYTES}}, "others": {"arena": 0}}
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas)
    alice = keys(6, "alice")
    store_chunks(store, alice, priority=100, tenant="alice")
    store.flush(5.0)
    store.close(drain_s=5)
    again = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas)
    assert again.rebuild() == len(alice)
    assert pinned(again, alice, "disk") == len(alice)
    again.check_integrity()


def test_a_restored_chunk_takes_a_lower_tiers_pin_only_within_the_arena_quota(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Alice's 6 chunks are pinned on disk (within her disk quota) but she may pin only 2 in
    the arena. They leave the arena; Carol stores them again at the default: the arena
    copies keep the disk pin only within Alice's arena quota."""
    quotas = {"tenants": {"alice": {"arena": 2 * SLOT_BYTES, "disk": 10 * CHUNK_BYTES}},
              "others": {"arena": 0, "disk": 0}}
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas)
    alice = keys(6, "alice")
    store_chunks(store, alice, priority=100, tenant="alice")
    store.flush(5.0)
    store.set_priority(alice, 100, tenant="alice")  # on disk all 6 fit her quota
    assert pinned(store, alice, "disk") == 6
    for n in range(12):
        store_chunks(store, keys(2, f"plain{n}"), tenant="carol")
        store.flush(5.0)
    gone = [k for k in alice if k not in store.index.entries]
    assert len(gone) >= 4
    store_chunks(store, gone, tenant="carol")  # recomputed and stored again
    store.flush(5.0)
    assert pinned(store, alice) <= 2
    assert store.quotas.used("alice", "arena") <= 2 * SLOT_BYTES
    store.check_integrity()


def test_a_promotion_charges_the_arena_quota_a_slot(tmp_path: Path,
                                                    make_store: MakeStore) -> None:
    """Slots twice a chunk's stored size. Alice's 6 chunks are pinned on disk, 2 of them in
    the arena (her quota there), until Bob's pins push them out. A load brings hers back
    into the arena, each charged a whole slot: no more than her 2 slots are pinned again
    (a charge by stored size let 4)."""
    slot = 2 * SLOT_BYTES
    quotas = {"tenants": {"alice": {"arena": 2 * slot, "disk": 10 * CHUNK_BYTES},
                          "bob": {"arena": 12 * slot}},  # overcommitted: Bob takes all
              "others": {"arena": 0, "disk": 0}}
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas, slot_bytes=slot)
    alice = keys(6, "alice")
    store_chunks(store, alice, priority=100, tenant="alice")
    store.flush(5.0)
    store.set_priority(alice, 100, tenant="alice")  # on disk all 6 fit her quota
    assert pinned(store, alice, "disk") == 6 and pinned(store, alice) == 2
    store_chunks(store, keys(12, "bob"), priority=100, tenant="bob")
    store.flush(5.0)
    assert not any(k in store.index.entries for k in alice)
    assert load(store, alice).payloads == expected(alice)
    assert pinned(store, alice) == 2
    assert store.quotas.used("alice", "arena") == 2 * slot
    store.check_integrity()


def test_a_pin_in_a_tier_without_a_limit_is_carried_as_its_tenants(
        tmp_path: Path, make_store: MakeStore) -> None:
    """Alice has no arena limit but 6 chunks on disk; ``others`` has 0 on disk. Her chunks
    written through to disk keep their pin there, counted as hers, not as ``others``'."""
    quotas = {"tenants": {"alice": {"disk": 6 * CHUNK_BYTES}}, "others": {"disk": 0}}
    store = make_store(tmp_path, slots=12, disk_bytes=40 * CHUNK_BYTES,
                       retention_quotas=quotas)
    alice = keys(4, "alice")
    store_chunks(store, alice, priority=100, tenant="alice")
    store.flush(5.0)
    assert pinned(store, alice) == 4 and pinned(store, alice, "disk") == 4
    assert store.quotas.used("alice", "disk") == 4 * CHUNK_BYTES
    assert store.quotas.used("others", "disk") == 0
    store.check_integrity()


def test_an_admit_over_the_limit_looks_at_a_bounded_number_of_pins() -> None:
    """Alice holds 40 000 pins, her whole quota on disk; each admit over the limit asks
    whether at most SCAN_MAX of them are still held, however many she has. When all are held
    her new pin is clipped; once they leave, each admit finds room at once. In the arena,
    where she has no limit, pins that left are forgotten as she goes: the table stays small."""
    many = 40_000
    quotas = Quotas(QuotaConfig(tenants={"alice": {"disk": many}}), StoreMetrics())
    asked: list[object] = []
    gone: set[object] = set()

    def held(key: object) -> bool:
        asked.append(key)
        return key not in gone

    pins = [b"%d" % i for i in range(many)]
    assert quotas.admit("alice", "disk", pins, lambda _: 1, held) == many
    for n in range(5):
        asked.clear()
        assert quotas.admit("alice", "disk", [b"new%d" % n], lambda _: 1, held) == 0
        assert 0 < len(asked) <= SCAN_MAX
    gone.update(pins)
    for n in range(100):
        asked.clear()
        assert quotas.admit("alice", "disk", [b"x%d" % n], lambda _: 1, held) == 1
        assert len(asked) == 1  # the oldest pin had left: room enough
    assert quotas.used("alice", "disk") == many
    for n in range(10_000):
        key = b"arena%d" % n
        assert quotas.admit("alice", "arena", [key], lambda _: 1, held) == 1
        gone.add(key)
    assert quotas.used("alice", "arena") <= 100
    quotas.check_integrity()
