"""Retention quotas in the store: a tenant pins at most its bytes per tier, and its surplus
never evicts another tenant's retained chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import CHUNK_BYTES, SLOT_BYTES, MakeStore, keys, sample, store_chunks

from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_PRIORITY
from kvtier.store import TieredStore

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
