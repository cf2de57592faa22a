"""Listing what a lower tier holds, bounded: a tier that is down or hangs at start must not
keep the server from serving from the arena.

The listing runs on a thread of its own; the caller waits while it makes progress (the tier
answered within ``io_timeout_s`` of the last chunk found) and gives up once it stalls for
longer. A listing given up keeps running on its daemon thread, but what it finds is dropped.
"""

from __future__ import annotations

import logging
import threading
import time

from kvtier.errors import TierError, TierIOError, TierTimeout
from kvtier.store.lower import LowerTierState
from kvtier.tiers import Space
from kvtier.tiers.base import StoredChunk

log = logging.getLogger("kvtier.store")


class _Listing:
    def __init__(self, state: LowerTierState) -> None:
        self.state = state
        self.space: Space | None = None
        self.found: list[StoredChunk] = []
        self.error: BaseException | None = None
        self.progress = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.space = self.state.tier.space()
            self.progress = time.monotonic()
            for chunk in self.state.tier.scan():
                self.found.append(chunk)
                self.progress = time.monotonic()
        except BaseException as exc:  # handed to the waiting thread
            self.error = exc
        finally:
            self.done.set()


def bounded_scan(state: LowerTierState) -> tuple[Space | None, list[StoredChunk]]:
    """The tier's free space and every chunk it holds.

    Raises TierError when the tier fails, TierTimeout when it stops answering for longer
    than ``io_timeout_s``.
    """
    listing = _Listing(state)
    thread = threading.Thread(target=listing.run, daemon=True,
                              name=f"kvtier-{state.name}-scan")
    thread.start()
    timeout = state.config.io_timeout_s
    while not listing.done.wait(min(0.05, timeout)):
        if time.monotonic() - listing.progress > timeout:
            raise TierTimeout(f"tier {state.name}: listing stalled for over {timeout:g} s")
    if isinstance(listing.error, TierError):
        raise listing.error
    if isinstance(listing.error, OSError):
        raise TierIOError(f"tier {state.name}: listing failed: {listing.error}") from listing.error
    if isinstance(listing.error, Exception):  # garbage a peer left must not stop a start
        log.error("tier %s: listing failed", state.name, exc_info=listing.error)
        raise TierIOError(f"tier {state.name}: listing failed: "
                          f"{type(listing.error).__name__}: {listing.error}") from listing.error
    if listing.error is not None:
        raise listing.error
    return listing.space, listing.found


def newest_that_fit(found: list[StoredChunk], room: int
                    ) -> tuple[list[StoredChunk], list[StoredChunk]]:
    """Of the chunks a listing found, the newest that fit ``room`` bytes, oldest first (the
    order the eviction policy wants them indexed in), and the ones left out."""
    kept: list[StoredChunk] = []
    left: list[StoredChunk] = []
    for chunk in sorted(found, key=lambda c: c.mtime, reverse=True):
        if chunk.size > room:
            left.append(chunk)
            continue
        room -= chunk.size
        kept.append(chunk)
    kept.reverse()
    return kept, left
