"""Counting what a tier's listings pass over, and saying so without flooding the log.

A shared tier is written by others, so a listing meets entries that do not belong: a stray
file, a link, a FIFO, garbage in an index. Each is skipped and counted, never allowed to fail
the listing; the log gets a line when something new appears, not one per entry or per pass.
Two shapes fit the backends:

- :class:`Skipped` (files): per place, the number one listing found; logged when it changes;
- :class:`Skips` (Redis, S3): per kind; logged when it appears, and again once a complete pass
  met none of it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("kvtier.tiers")

class Skipped:
    """Entries a listing passed over: of the wrong type, or a name that does not parse.

    Counted (``total``) and logged when the number one listing finds changes, not per entry
    nor per listing: a stray file lying there for a week is one line, not ten thousand."""

    _MAX_PLACES = 4096

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.total = 0
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def report(self, where: str, count: int, example: str = "") -> None:
        with self._lock:
            self.total += count
            if len(self._last) >= self._MAX_PLACES:
                self._last.clear()
            changed = self._last.get(where, 0) != count
            self._last[where] = count
        if changed and count:
            log.warning("%s tier: skipped %d entries in %s that are not what belongs there "
                        "(a link, a FIFO, a folder or file in the other's place, or a name "
                        "that does not parse), e.g. %.80r", self.tier, count, where, example)



class Skips:
    """Bad entries skipped, by kind. A kind is logged when it appears and again when a
    complete pass meets none of it, never once per entry (a listing may skip thousands)."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.counts: Counter[str] = Counter()
        self._present: set[str] = set()
        self._lock = threading.Lock()  # the tier's I/O threads skip concurrently

    def add(self, kind: str, n: int = 1, where: str = "") -> None:
        if n <= 0:
            return
        with self._lock:
            self.counts[kind] += n
            new = kind not in self._present
            self._present.add(kind)
        if new:
            log.warning("tier %s: skipping %s%s (written by another program or a faulty "
                        "peer; counted, logged again only once it is gone)", self.tier, kind,
                        f" in {where}" if where else "")

    def snapshot(self) -> Counter[str]:
        """The counts now, for :meth:`settle` at the end of a complete pass."""
        with self._lock:
            return Counter(self.counts)

    def settle(self, before: Counter[str], kinds: tuple[str, ...]) -> None:
        """A complete pass over every entry of ``kinds`` began at ``before``: the kinds it
        met none of are gone."""
        with self._lock:
            gone = sorted(k for k in kinds if k in self._present
                          and self.counts[k] == before[k])
            self._present.difference_update(gone)
        for kind in gone:
            log.info("tier %s: no more %s (%d skipped in all)", self.tier, kind,
                         self.counts[kind])

    def total(self) -> int:
        return sum(self.counts.values())
