"""Retention quotas: the bytes each tenant may hold above the default priority, per tier.

::

    set_priority / reserve / write / promotion of keys at priority > 35 for tenant T in tier X
        └─► Quotas.admit(T, X, keys): the head of the keys that fits T's quota in X
              (what T pinned there before and no longer holds above 35 — evicted,
               released, past its deadline — is forgotten first, oldest first, a
               bounded number looked at per call)
        └─► the rest keep the default priority; counted in
            kvtier_retention_quota_clipped_chunks_total{tier}

So a tenant cannot pin more than its quota, however much it asks, and pinned chunks of
another tenant within its own quota never give way to its surplus: the surplus sits at the
default priority, below them. A chunk copied to a lower tier or promoted to the arena keeps
its priority only within the quota there of the tenant that pinned it (a chunk no tenant
pinned here, a peer's, counts for ``others``); so does a chunk stored again into the arena
while a lower tier holds it pinned. A pin listed at a start has no known tenant: in a tier
where a quota applies it is kept only within ``others``' quota there (none if ``others`` has
no limit there), so a restart never grants a tenant its quota again.

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
SCAN_MAX = 1024
"""Pins an admit over the limit looks at, at most, for ones no longer held (under 1 ms)."""
SWEEP = 64
"""Pins any admit looks at besides twice its keys: the tables stay near what is held."""
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
        """How many of ``keys`` (head first) ``tenant`` may pin in ``tier``; records them
        (in a tier where the tenant has no limit too: a copy of them is carried as its)."""
        if not self._limits:
            return len(keys)
        bucket = self.bucket(tenant)
        limit = self._limits[bucket].get(tier)
        sizes = [size_of(k) for k in keys]
        slot = (bucket, tier)
        pins = self._pins.setdefault(slot, OrderedDict())
        over = 0 if limit is None else self._used.get(slot, 0) - limit + sum(
            s for k, s in zip(keys, sizes, strict=True) if k not in pins)
        self._forget_unheld(slot, held, over, SCAN_MAX if over > 0 else 2 * len(keys) + SWEEP)
        used = self._used.get(slot, 0)
        admitted = 0
        for key, size in zip(keys, sizes, strict=True):
            if key not in pins:
                if limit is not None and used + size > limit:
                    break
                pins[key] = size
                used += size
            self._owner[(tier, key)] = bucket
            admitted += 1
        self._used[slot] = used
        if limit is not None:
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

    def relisted(self, tier: str, keys: Sequence[Hashable], size_of: SizeOf,
                 held: Held) -> int:
        """How many of ``keys``, listed in ``tier`` at a start with a pin whose tenant is
        not known any more, keep it: all where no quota applies in the tier, else those
        within ``others``' quota there (none if ``others`` has no limit there)."""
        if not any(tier in limits for limits in self._limits.values()):
            return len(keys)
        if tier not in self._limits[OTHERS]:
            if keys:
                self._metrics.quota_clipped.labels(tier).inc(len(keys))
            return 0
        return self.admit(OTHERS, tier, keys, size_of, held)

    def _forget_unheld(self, slot: tuple[str, str], held: Held, wanted: int,
                       budget: int) -> None:
        """Forget the pins of ``slot`` no longer held, oldest first, looking at ``budget``
        of them at most (a held one goes to the back), or until ``wanted`` bytes are free
        (``wanted`` <= 0: look at the whole budget): the work per call stays bounded."""
        pins = self._pins[slot]
        freed = 0
        for _ in range(min(budget, len(pins))):
            key = next(iter(pins))
            if held(key):
                pins.move_to_end(key)
                continue
            size = pins.pop(key)
            freed += size
            self._used[slot] -= size
            if self._owner.get((slot[1], key)) == slot[0]:
                del self._owner[(slot[1], key)]
            if 0 < wanted <= freed:
                break

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
