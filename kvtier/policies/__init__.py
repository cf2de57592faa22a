"""Eviction and admission policies, registered by name."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from kvtier.policies.base import (
    AdmissionContext,
    AdmissionPolicy,
    Algorithm,
    EvictionPolicy,
)
from kvtier.policies.retention import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    MAX_RETAIN_S,
    MIN_PRIORITY,
    RELEASE,
    Retention,
    check_duration,
    check_priority,
    effective,
)
from kvtier.registry import Registry

EVICTION: Registry[Algorithm[Hashable]] = Registry("eviction policy")
EVICTION.register("lru", "kvtier.policies.lru:LRU")
EVICTION.register("arc", "kvtier.policies.arc:ARC")
EVICTION.register("s3fifo", "kvtier.policies.s3fifo:S3FIFO")
EVICTION.register("prefix", "kvtier.policies.prefix:PrefixAware")

ADMISSION: Registry[AdmissionPolicy] = Registry("admission rule")
ADMISSION.register("always", "kvtier.policies.admission:Always")
ADMISSION.register("after_uses", "kvtier.policies.admission:AfterUses")
ADMISSION.register("min_priority", "kvtier.policies.admission:MinPriority")
ADMISSION.register("min_prefix_tokens", "kvtier.policies.admission:MinPrefixTokens")


def make_eviction(name: str, capacity: int, clock: Callable[[], float] | None = None, *,
                  sharded: bool = True) -> EvictionPolicy[Hashable]:
    """A priority-aware eviction policy running algorithm ``name`` over ``capacity`` entries
    (retention deadlines read against ``clock``, default ``time.monotonic``; ``sharded``: see
    :class:`EvictionPolicy`)."""
    return EvictionPolicy(EVICTION[name], capacity, clock or time.monotonic, sharded=sharded)


def make_admission(rules: Sequence[tuple[str, int]]) -> list[AdmissionPolicy]:
    return [ADMISSION[name](param) for name, param in rules]


def admits(rules: Sequence[AdmissionPolicy], ctx: AdmissionContext) -> bool:
    return all(rule.admit(ctx) for rule in rules)


__all__ = [
    "ADMISSION",
    "DEFAULT_PRIORITY",
    "EVICTION",
    "MAX_PRIORITY",
    "MAX_RETAIN_S",
    "MIN_PRIORITY",
    "RELEASE",
    "AdmissionContext",
    "AdmissionPolicy",
    "Algorithm",
    "EvictionPolicy",
    "Retention",
    "admits",
    "check_duration",
    "check_priority",
    "effective",
    "make_admission",
    "make_eviction",
]
