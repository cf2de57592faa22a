"""Reading the redis tier's index as untrusted input: what other writers put under its keys.

Any program with access to the Redis server can add members to the namespace set, the
indexes and the size hashes, or put a value of another type under one of the tier's keys.
Each entry is parsed here; one that does not parse is skipped and counted (:class:`Skips`),
so garbage costs a listing that entry, never the listing, a scan or a server's start.
:class:`Skips` counts for the s3 tier too (it does not need redis-py).
"""

from __future__ import annotations

import logging
import math
import re

from kvtier.tiers.shared import NOTE_NAME

log = logging.getLogger("kvtier.tiers")

HEX64 = re.compile(rb"[0-9a-f]{64}")
DIGITS = re.compile(rb"[0-9]{1,18}")
"""A size: decimal digits, fewer than 19 (so below 2**63; larger is no chunk)."""
CLOCK_SKEW_S = 300.0
"""Index scores (write or touch times) later than now plus this are taken as now."""


def hex_member(member: bytes) -> str | None:
    """A namespace or key member of the index (64 lowercase hex digits), else None."""
    return member.decode("ascii") if HEX64.fullmatch(member) else None


def note_member(member: bytes) -> str | None:
    """A member of the note name index that is a valid note name, else None."""
    try:
        name = member.decode("ascii")
    except UnicodeDecodeError:
        return None
    return name if NOTE_NAME.fullmatch(name) and ".." not in name else None


def size_of(value: bytes | None, most: int) -> int | None:
    """A size hash value: a positive decimal integer no larger than ``most`` (the tier's
    capacity: no chunk is larger), else None."""
    if value is None or not DIGITS.fullmatch(value):
        return None
    size = int(value)
    return size if 0 < size <= most else None


def mtime_of(score: float, now: float) -> float:
    """An index score as a time: what is not a time is 0 (oldest), the future is now."""
    if not math.isfinite(score) or score < 0:
        return 0.0
    return min(score, now + CLOCK_SKEW_S)


def is_wrongtype(exc: object) -> bool:
    """Redis refused a command because the key holds a value of another type."""
    if not isinstance(exc, Exception):
        return False
    from redis.exceptions import ResponseError  # here: the s3 tier uses Skips without redis

    return isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE")


