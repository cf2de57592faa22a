"""Retention quotas: the bytes each tenant may hold above the default priority, per tier.

::

    set_priority / reserve / write / promotion of keys at priority > 35 for tenant T in tier X
        └─► Quotas.admit(T, X, keys): the head of the keys that fits T's quota in X
              (what T pinned there before and no longer holds above 35 — evicted,
               released, past its deadline — is forgotten first, only when needed)
        └─► the rest keep the default priority; counted in
            kvtier_retention_quota_clipped_chunks_total{tier}

So a tenant cannot pin more than its quota, however much it asks, and pinned chunks of
another tenant within its own quota never give way to its surplus: the surplus sits at the
default priority, below them. A chunk copied to a lower tier or promoted to the arena keeps
its priority only within the quota there of the tenant that pinned it (a chunk no tenant
pinned here — a peer's, or listed at a start — counts for ``others``).

The tenant is a name the request gives (``kv_transfer_params.kvtier.tenant``, set by the
router); the table holds the configured tenants plus ``others``, so a client naming tenants
at random only ever reaches ``others``. State is per (tenant, tier): the keys pinned and
their bytes; a key is in the tables of those that pinned it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from kvtier.config import QuotaConfig
from kvtier.metrics import StoreMetrics

ARENA_TIER = "arena"
DEFAULT_TENANT = "default"
OTHERS = "others"
Held = Callable[[Hashable], bool]
"""Whether the key is held above the default priority in the tier now."""
SizeOf = Callable[[Hashable], int]


class Quotas:
    def __init__(self, config: QuotaConfig | None, metrics: StoreMetrics) -> None:
        self._limits: dict[str, dict[str, int]] = {}
        if config is not None:
            self._limits = {**config.tenants, OTHERS: dict(config.others)}
        self._metrics = metrics
        for tenant, limits in self._limits.items():
            for tier, limit in limits.items():
                metrics.quota_limit.labels(tenant, tier).set(limit)
                metrics.quota_used.labels(tenant, tier).set(0)
        self._pins: dict[tuple[str, str], OrderedDict[Hashable, int]] = {}
        self._used: dict[tuple[str, str], int] = {}
        self._owner: dict[tuple[str, Hashable], str] = {}
        """(tier, key) -> the tenant whose pin it is there (the last that pinned it)."""

    @property
    def active(self) -> bool:
        return bool(self._limits)

    def bucket(self, tenant: str | None) -> str:
        name = tenant or DEFAULT_TENANT
        return name if name in self._limits and name != OTHERS else OTHERS

    def admit(self, tenant: str | None, tier: str, keys: Sequence[Hashable], size_of: SizeOf,
              held: Held) -> int:
        """How many of ``keys`` (head first) ``tenant`` may pin in ``tier``; records them."""
        if not self._limits:
            return len(keys)
        bucket = self.bucket(tenant)
        limit = self._limits[bucket].get(tier)
        if limit is None:
            return len(keys)
        sizes = [size_of(k) for k in keys]
        slot = (bucket, tier)
        pins = self._pins.setdefault(slot, OrderedDict())
        if self._used.get(slot, 0) + sum(s for k, s in zip(keys, sizes, strict=True)
                                         if k not in pins) > limit:
            self._forget_unheld(slot, held)
        used = self._used.get(slot, 0)
        admitted = 0
        for key, size in zip(keys, sizes, strict=True):
            if key not in pins:
                if used + size > limit:
                    break
                pins[key] = size
                used += size
            self._owner[(tier, key)] = bucket
            admitted += 1
        self._used[slot] = used
        self._metrics.quota_used.labels(bucket, tier).set(used)
        if admitted < len(keys):
            self._metrics.quota_clipped.labels(tier).inc(len(keys) - admitted)
        return admitted

    def carry(self, source: str, tier: str, key: Hashable, size: int, held: Held) -> bool:
        """Whether the pin of ``key`` in ``source`` may come along to ``tier`` (a copy or a
        promotion), within the quota there of the tenant that pinned it."""
        if not self._limits:
            return True
        owner = self._owner.get((source, key), OTHERS)
        return self.admit(owner, tier, [key], lambda _: size, held) == 1

    def _forget_unheld(self, slot: tuple[str, str], held: Held) -> None:
        pins = self._pins[slot]
        gone = [k for k in pins if not held(k)]
        for key in gone:
            self._used[slot] -= pins.pop(key)
            if self._owner.get((slot[1], key)) == slot[0]:
                del self._owner[(slot[1], key)]
        self._metrics.quota_used.labels(*slot).set(self._used.get(slot, 0))

    def used(self, tenant: str | None, tier: str) -> int:
        """Bytes counted against ``tenant``'s quota in ``tier`` (some may have left since)."""
        return self._used.get((self.bucket(tenant), tier), 0)

    def check_integrity(self) -> None:
        for slot, pins in self._pins.items():
            assert sum(pins.values()) == self._used.get(slot, 0), f"quota bytes of {slot}"
            limit = self._limits[slot[0]].get(slot[1])
            assert limit is None or self._used[slot] <= limit, f"{slot} over its quota"
        for (tier, key), bucket in self._owner.items():
            assert key in self._pins.get((bucket, tier), {}), f"owner of {tier} key unpinned"
