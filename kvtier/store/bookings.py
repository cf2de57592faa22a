"""A lower tier's bookings: chunks in its books on a peer's word alone, bounded per peer and tier.

Another server's journal record ``+`` says it wrote a chunk; nothing here has seen it yet. The
books take it (a lookup finds it at once) as a *booking* of that peer (the writer named by the
note), until this server reads and verifies the chunk or a listing finds it (it is
*confirmed*: :meth:`TierBooks.confirm`), or a miss, a ``-`` record, an eviction or a listing
drops it. Whoever may write the journal may book chunks that do not exist, so bookings are
bounded (:class:`Limits`) and cost at most their own room: :meth:`TierBooks.make_room` takes
room from bookings first by forgetting them (never deleting them: a booking may be its peer's
verified chunk), and evicts a confirmed chunk only for the room confirmed chunks need::

    per peer   entries <= peer_entries     bytes <= peer_bytes  (the whole tier)
    per tier   entries <= tier_entries     bytes <= tier_bytes  (twice that)

A record past a bound is refused (:meth:`refusal`) and counted; the first refusal says so in
the log and so does the end of it (once the bookings fell below three quarters of the bound),
not every record.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from kvtier.errors import IntegrityError
from kvtier.shards import ShardedDict

log = logging.getLogger("kvtier.store")
MIN_ENTRIES = 1024
"""Bookings one peer may hold at least, however small the tier."""
Limit = Literal["peer", "tier"]
"""Which bound refused a booking (the ``limit`` label of ``kvtier_bookings_refused_total``)."""


@dataclass(frozen=True, slots=True)
class Limits:
    peer_entries: int
    peer_bytes: int
    tier_entries: int
    tier_bytes: int

    @classmethod
    def of(cls, capacity: int, chunk_bytes: int) -> Limits:
        """Bounds for a tier of ``capacity`` bytes whose chunks take at most ``chunk_bytes``:
        one peer may book what the tier holds (twice its chunks, for smaller ones), all peers
        together twice that."""
        entries = max(MIN_ENTRIES, 2 * (capacity // max(1, chunk_bytes)))
        return cls(entries, capacity, 2 * entries, 2 * capacity)


class Bookings:
    """The bookings of one tier's books, by peer; changed only by :class:`TierBooks`."""

    def __init__(self, tier: str, limits: Limits) -> None:
        self.tier = tier
        self.limits = limits
        self.peer_of: ShardedDict[Hashable, str] = ShardedDict()
        self.bytes = 0
        self._count: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._full: set[str] = set()
        """Peers refused at their bound, until they fall below three quarters of it."""
        self._tier_full = False
        self._said_peer = False
        self.refused: dict[Limit, int] = {"peer": 0, "tier": 0}

    @property
    def count(self) -> int:
        return len(self.peer_of)

    def __contains__(self, key: object) -> bool:
        return key in self.peer_of

    def per_peer_counts(self) -> Iterator[int]:
        return iter(self._count.values())

    def refusal(self, peer: str, size: int) -> Limit | None:
        """Which bound a booking of ``size`` bytes by ``peer`` would break (``None``: none);
        a refusal is counted and, on a change of state, logged."""
        lim = self.limits
        if (self._count.get(peer, 0) >= lim.peer_entries
                or self._bytes.get(peer, 0) + size > lim.peer_bytes):
            self._refuse_peer(peer)
            return "peer"
        if len(self.peer_of) >= lim.tier_entries or self.bytes + size > lim.tier_bytes:
            self._refuse_tier()
            return "tier"
        return None

    def _refuse_peer(self, peer: str) -> None:
        self.refused["peer"] += 1
        if peer in self._full:
            return
        self._full.add(peer)
        lim = self.limits
        level = logging.DEBUG if self._said_peer else logging.WARNING
        self._said_peer = True
        log.log(level, "tier %s: peer %s booked %d chunks (%d bytes) that this server has not "
                "verified, its bound (%d chunks, %d bytes); its further records are refused "
                "and counted in kvtier_bookings_refused_total{limit=\"peer\"} (other peers "
                "reaching theirs are logged at DEBUG)", self.tier, peer,
                self._count.get(peer, 0), self._bytes.get(peer, 0), lim.peer_entries,
                lim.peer_bytes)

    def _refuse_tier(self) -> None:
        self.refused["tier"] += 1
        if self._tier_full:
            return
        self._tier_full = True
        lim = self.limits
        log.warning("tier %s: peers booked %d chunks (%d bytes) that this server has not "
                    "verified, the tier's bound (%d chunks, %d bytes); further records are "
                    "refused and counted in kvtier_bookings_refused_total{limit=\"tier\"}",
                    self.tier, len(self.peer_of), self.bytes, lim.tier_entries,
                    lim.tier_bytes)

    # ------------------------------------------------------------------ TierBooks only

    def book(self, key: Hashable, peer: str, size: int) -> None:
        self.peer_of[key] = peer
        self.bytes += size
        self._count[peer] = self._count.get(peer, 0) + 1
        self._bytes[peer] = self._bytes.get(peer, 0) + size

    def drop(self, key: Hashable, size: int) -> None:
        """``key`` (booked or not) left the books or was confirmed."""
        peer = self.peer_of.pop(key, None)
        if peer is None:
            return
        self.bytes -= size
        left = self._count[peer] - 1
        if left:
            self._count[peer] = left
            self._bytes[peer] -= size
        else:
            del self._count[peer], self._bytes[peer]
        if self._full and peer in self._full:
            self._eased(peer, left)
        if self._tier_full and 4 * len(self.peer_of) < 3 * self.limits.tier_entries \
                and 4 * self.bytes < 3 * self.limits.tier_bytes:
            self._tier_full = False
            log.info("tier %s: peers' bookings are below the tier's bound again (%d refused "
                     "so far)", self.tier, self.refused["tier"])

    def _eased(self, peer: str, left: int) -> None:
        lim = self.limits
        if 4 * left < 3 * lim.peer_entries and 4 * self._bytes.get(peer, 0) < 3 * lim.peer_bytes:
            self._full.discard(peer)
            log.debug("tier %s: peer %s is below its bound of bookings again", self.tier, peer)

    def check_integrity(self, sizes: Mapping[Hashable, int]) -> None:
        if any(key not in sizes for key in self.peer_of):
            raise IntegrityError(f"tier {self.tier}: a booking is not in the books")
        if self.bytes != sum(sizes[key] for key in self.peer_of):
            raise IntegrityError(f"tier {self.tier}: booked bytes {self.bytes} != their sizes")
        if sum(self._count.values()) != len(self.peer_of):
            raise IntegrityError(f"tier {self.tier}: bookings per peer do not add up")
