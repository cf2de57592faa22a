"""Retention: how long a chunk is worth keeping, as a priority and an optional duration.

A chunk's retention is a priority on TensorRT-LLM's scale (0-100, default 35: eviction takes
the lowest first) and, optionally, a time after which the priority falls back to the default.
A request sets it for its prefix (or for token ranges of it); a *release* drops its prefix to
the lowest priority at once. Durations are checked here, at the edge, and never reach the
policies as anything but a finite deadline::

    Retention(80, 30.0)   priority 80 for 30 s, then 35
    Retention(80)         priority 80 until changed
    RELEASE               priority 0 now

The deadline is absolute on the clock of the policy that holds the chunk (the store's
monotonic clock, a trace's timestamps in the simulator); it does not survive a restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_PRIORITY = 35
MIN_PRIORITY = 0
MAX_PRIORITY = 100
MAX_RETAIN_S = 86_400.0
"""The longest duration a retention may ask for (a day); a longer one is refused."""


def check_priority(priority: object) -> int:
    """The priority as an int; raises ValueError naming the allowed range otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer in [0, 100], got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in [0, 100], got {priority}")
    return priority


def check_duration(duration_s: object, limit_s: float = MAX_RETAIN_S) -> float | None:
    """A retention's duration in seconds (``None``: no fallback); raises ValueError naming
    what is allowed for anything else: it must be a finite number in (0, ``limit_s``]."""
    if duration_s is None:
        return None
    if isinstance(duration_s, bool) or not isinstance(duration_s, int | float):
        raise ValueError(f"duration_s must be a number of seconds in (0, {limit_s:g}] or "
                         f"null, got {type(duration_s).__name__}")
    if isinstance(duration_s, int) and abs(duration_s) > 1 << 53:
        raise ValueError(f"duration_s must be in (0, {limit_s:g}] seconds, got a huge number")
    value = float(duration_s)
    if not math.isfinite(value) or not 0.0 < value <= limit_s:
        raise ValueError(f"duration_s must be in (0, {limit_s:g}] seconds, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Retention:
    """A priority and an optional duration (seconds) after which it falls back to 35."""

    priority: int = DEFAULT_PRIORITY
    duration_s: float | None = None

    def __post_init__(self) -> None:
        check_priority(self.priority)
        check_duration(self.duration_s)

    def until(self, now: float) -> float | None:
        """The deadline on a clock that reads ``now``; ``None`` when it never falls back
        (no duration, or the default priority, which has nothing to fall back from)."""
        if self.duration_s is None or self.priority == DEFAULT_PRIORITY:
            return None
        return now + self.duration_s


RELEASE = Retention(MIN_PRIORITY)
"""What a release sets: the lowest priority, now and until changed."""


def effective(priority: int, until: float | None, now: float) -> tuple[int, float | None]:
    """``(priority, until)`` as it stands at ``now``: past its deadline, the default."""
    if until is not None and now >= until:
        return DEFAULT_PRIORITY, None
    return priority, until
