"""Eviction and admission policies, registered by name."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvtier.policies.base import (
    DEFAULT_PRIORITY,
    AdmissionContext,
    AdmissionPolicy,
    Algorithm,
    EvictionPolicy,
    check_priority,
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


def make_eviction(name: str, capacity: int) -> EvictionPolicy[Hashable]:
    """A priority-aware eviction policy running algorithm ``name`` over ``capacity`` entries."""
    return EvictionPolicy(EVICTION[name], capacity)


def make_admission(rules: Sequence[tuple[str, int]]) -> list[AdmissionPolicy]:
    return [ADMISSION[name](param) for name, param in rules]


def admits(rules: Sequence[AdmissionPolicy], ctx: AdmissionContext) -> bool:
    return all(rule.admit(ctx) for rule in rules)


__all__ = [
    "ADMISSION",
    "DEFAULT_PRIORITY",
    "EVICTION",
    "AdmissionContext",
    "AdmissionPolicy",
    "Algorithm",
    "EvictionPolicy",
    "admits",
    "check_priority",
    "make_admission",
    "make_eviction",
]
