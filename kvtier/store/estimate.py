"""Moving averages of how fast a tier serves chunk reads, for load-or-recompute.

The store times every promotion (read + verify) and keeps exponentially weighted averages of
seconds per chunk and bytes per second. A lookup turns them into an estimated arrival time
for each chunk of a hit: a tier with ``threads`` readers and ``queued`` jobs ahead delivers
its ``i``-th chunk of the hit after about ``ceil((queued + i + 1) / threads)`` chunk times.

An estimate with no sample for ``stale_s`` is forgotten (``None``: unknown, so the client
loads and measures again): a tier that was slow once is not skipped forever.
"""

from __future__ import annotations

import math


class ReadEstimate:
    def __init__(self, alpha: float = 0.2, stale_s: float = 60.0) -> None:
        self.alpha = alpha
        self.stale_s = stale_s
        self._chunk_s: float | None = None
        self._bytes_per_s: float | None = None
        self._at = -math.inf

    def observe(self, seconds: float, nbytes: int, now: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        fresh = self.chunk_s(now) is None
        rate = nbytes / seconds if seconds > 0 else None
        if fresh:
            self._chunk_s, self._bytes_per_s = seconds, rate
        else:
            assert self._chunk_s is not None
            self._chunk_s += self.alpha * (seconds - self._chunk_s)
            if rate is not None:
                old = self._bytes_per_s if self._bytes_per_s is not None else rate
                self._bytes_per_s = old + self.alpha * (rate - old)
        self._at = now

    def chunk_s(self, now: float) -> float | None:
        """Average seconds to read one chunk, or ``None`` when unknown or stale."""
        if now - self._at > self.stale_s:
            return None
        return self._chunk_s

    def bytes_per_s(self, now: float) -> float | None:
        return None if self.chunk_s(now) is None else self._bytes_per_s

    def arrivals(self, count: int, queued: int, threads: int, now: float) -> list[float]:
        """Estimated seconds until each of ``count`` chunks read from this tier is in the
        arena (0.0 each when unknown: try it, and learn)."""
        per = self.chunk_s(now)
        if per is None:
            return [0.0] * count
        return [per * math.ceil((queued + i + 1) / max(1, threads)) for i in range(count)]
