"""The store's bookkeeping for one tier below the arena.

The tier object itself only stores bytes; this record holds what the store decides with:
which chunks the tier holds and their sizes, the bytes in use and promised to writes in
flight, the eviction policy, the admission rules and the I/O thread pool::

    used + reserved <= capacity          (checked by check_integrity)
    keys(sizes) == keys(policy)          (every held chunk is evictable bookkeeping)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor

from kvtier.config import TierConfig
from kvtier.errors import IntegrityError
from kvtier.keys import ChunkKey
from kvtier.policies import (
    AdmissionContext,
    EvictionPolicy,
    admits,
    make_admission,
    make_eviction,
)
from kvtier.tiers import TIERS, LowerTier


class TierState:
    def __init__(self, config: TierConfig, chunk_bytes_hint: int,
                 tier: LowerTier | None = None) -> None:
        self.config = config
        self.name = config.name
        self.tier = tier or TIERS[config.type].from_config(config.name, config)
        self.capacity = config.capacity_bytes
        self.write_back = config.write_policy == "back"
        entries = max(1, self.capacity // max(1, chunk_bytes_hint))
        self.policy: EvictionPolicy[Hashable] = make_eviction(config.eviction, entries)
        self.admission = make_admission(config.admission)
        self.sizes: dict[ChunkKey, int] = {}
        self.deleting: set[ChunkKey] = set()
        """Keys whose delete is queued; not written again until it ran (the tier contract:
        never a write and a delete of one key at once)."""
        self.used = 0
        self.reserved = 0
        self.executor = ThreadPoolExecutor(config.io_threads,
                                           thread_name_prefix=f"kvtier-{self.name}")

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def record_use(self, key: ChunkKey) -> None:
        for rule in self.admission:
            rule.record(key)

    def admits(self, key: ChunkKey, priority: int, prefix_tokens: int) -> bool:
        return admits(self.admission, AdmissionContext(key, priority, prefix_tokens))

    def make_room(self, size: int, protected: Callable[[Hashable], bool]
                  ) -> list[ChunkKey] | None:
        """Evict until ``size`` more bytes fit, and promise them to a write.

        Returns the evicted keys (the caller deletes their files), or ``None`` if the chunk
        cannot fit even after evicting every unprotected chunk (nothing is evicted then).
        """
        if size > self.capacity:
            return None
        victims: list[ChunkKey] = []
        need = self.used + self.reserved + size - self.capacity
        if need > 0:
            freed = 0
            order = [k for k in self.policy.order() if not protected(k)]
            count = 0
            for key in order:
                if freed >= need:
                    break
                freed += self.sizes[ChunkKey(key)]  # type: ignore[arg-type]
                count += 1
            if freed < need:
                return None
            chosen = self.policy.evict(count, protected)
            assert chosen is not None
            for key in chosen:
                victims.append(ChunkKey(key))  # type: ignore[arg-type]
                self.used -= self.sizes.pop(ChunkKey(key))  # type: ignore[arg-type]
        self.reserved += size
        return victims

    def added(self, key: ChunkKey, size: int, promised: int, priority: int) -> None:
        """A write of ``key`` finished: account it and make it evictable."""
        self.reserved -= promised
        self.sizes[key] = size
        self.used += size
        self.policy.insert(key, priority)

    def forget(self, key: ChunkKey) -> None:
        """Drop ``key`` from the books (deleted, corrupt, or evicted elsewhere)."""
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used -= size
            self.policy.remove(key)

    def check_integrity(self) -> None:
        if set(self.sizes) != set(self.policy.order()):
            raise IntegrityError(f"tier {self.name}: index and eviction policy disagree")
        if self.used != sum(self.sizes.values()):
            raise IntegrityError(f"tier {self.name}: used bytes {self.used} != sum of sizes")
        if self.used + self.reserved > self.capacity or self.reserved < 0:
            raise IntegrityError(
                f"tier {self.name}: used {self.used} + reserved {self.reserved} exceeds "
                f"capacity {self.capacity}"
            )

    def close(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=not wait)
        self.tier.close()
