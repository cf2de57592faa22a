"""Redis's memory: what a chunk costs there, and what its limit and eviction policy mean.

A value costs what its allocator hands out, not its length: jemalloc rounds each allocation up
to a size class (four per power of two), and Redis adds a 9-byte string header and a NUL. A
1 MiB chunk (the header page plus a payload a page short of 1 MiB) therefore takes 1.25 MiB, as
does one of 1 MiB + 4 KiB; measured with ``INFO memory`` on Redis 7.0, a chunk also costs about
460 bytes of key, index entry and size entry. :func:`footprint` is that estimate: what a chunk
counts against ``capacity_bytes``, so kvtier's budgets and Redis's ``maxmemory`` speak of the
same bytes.

kvtier may leave the volume's total to Redis (``maxmemory`` with an ``allkeys-*`` policy, or a
``volatile-*`` one with ``chunk_ttl_s``), or keep it under its own budgets with ``noeviction``
and room to spare; docs/shared.md says how. Managed services often refuse ``CONFIG``:
then the settings are unknown and nothing is said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EvictionFacts:
    maxmemory: int | None
    """Bytes (0: no limit); ``None`` where CONFIG GET was refused or the server unreachable."""
    policy: str | None


UNKNOWN = EvictionFacts(None, None)
STRING_OVERHEAD = 10
"""A Redis string's header (sdshdr32) and terminating NUL, allocated with its bytes."""
PER_CHUNK_BYTES = 460
"""Key, object, dict entry, index and size entries of one chunk (measured, Redis 7.0)."""


def size_class(n: int) -> int:
    """jemalloc's allocation for ``n`` bytes: four classes per power of two (16 B quantum)."""
    if n <= 16:
        return 16
    step = 1 << max((n - 1).bit_length() - 3, 4)
    return -(-n // step) * step


def footprint(value_bytes: int) -> int:
    """The estimated memory a chunk of ``value_bytes`` takes in Redis, all included."""
    return size_class(value_bytes + STRING_OVERHEAD) + PER_CHUNK_BYTES


def read_facts(client: Any) -> EvictionFacts:
    """``CONFIG GET maxmemory*``; a refused CONFIG (renamed, ACL) gives :data:`UNKNOWN`.
    Connection errors propagate (the caller translates them)."""
    from redis.exceptions import ResponseError

    try:
        got = client.config_get("maxmemory*")
    except ResponseError:
        return UNKNOWN
    text = {_text(k): _text(v) for k, v in dict(got).items()}
    memory, policy = text.get("maxmemory"), text.get("maxmemory-policy")
    return EvictionFacts(int(memory) if memory and memory.isdigit() else None, policy)


def combine(facts: list[EvictionFacts]) -> EvictionFacts:
    """A cluster's facts from its primaries': the sum of their limits (0 if one has none,
    unknown if one refused), the first one's policy."""
    if not facts or any(f.maxmemory is None for f in facts):
        return UNKNOWN
    limits = [f.maxmemory for f in facts if f.maxmemory is not None]
    return EvictionFacts(0 if 0 in limits else sum(limits), facts[0].policy)


def eviction_warning(facts: EvictionFacts, capacity_bytes: int,
                     chunk_ttl_s: float | None) -> str | None:
    """One sentence when Redis's settings will hurt: it can grow without bound, it refuses
    writes below the tier's capacity, or its policy can evict nothing kvtier stores."""
    policy, memory = facts.policy, facts.maxmemory
    if policy is None or memory is None:
        return None
    if memory == 0:
        return ("Redis has no maxmemory: nothing but kvtier's own budgets bounds it; set "
                "maxmemory (with allkeys-lru, or volatile-lru and chunk_ttl_s) so Redis "
                "cannot outgrow its host")
    if policy == "noeviction" and memory < capacity_bytes:
        return (f"Redis refuses writes at maxmemory {memory} bytes with noeviction, below "
                f"this tier's capacity_bytes {capacity_bytes}: writes will fail as full; raise "
                "maxmemory, lower capacity_bytes or choose allkeys-lru")
    if policy.startswith("volatile-") and chunk_ttl_s is None:
        return (f"Redis's maxmemory-policy {policy} evicts only keys with a TTL and chunks "
                "have none: set chunk_ttl_s, or writes will fail as full at maxmemory")
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
