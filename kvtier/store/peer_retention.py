"""A peer's retention of a chunk of a shared tier, as this server's books may honour it.

A ``+`` record of another server's journal may say the chunk is retained: a priority and for
how many seconds after the note (:mod:`kvtier.store.journal`). That is input from another
writer, so this tier's sharing options cap it before it reaches the books::

    priority   min(theirs, max_peer_priority)
    duration   min(theirs - the note's age, max_peer_retention_s)   (theirs nil: the cap)
    expired    (duration <= 0) no retention: the record is an ordinary booking

A retained booking is still a booking: room is taken from bookings before any chunk this
server verified (:meth:`kvtier.store.placement.TierBooks.make_room`), whatever their priority,
so a peer's retention orders only the peer's word among itself, and a verified chunk it names
at most ``max_peer_priority`` for ``max_peer_retention_s``.
"""

from __future__ import annotations

from typing import NamedTuple

from kvtier.policies.retention import DEFAULT_PRIORITY


class Caps(NamedTuple):
    max_priority: int
    max_s: float


def capped(priority: int | None, retain_s: float | None, age_s: float, caps: Caps
           ) -> tuple[int, float] | None:
    """``(priority, seconds from now)`` this server keeps a peer's retained chunk at, or
    ``None`` for none (none asked, the default, or expired). ``priority`` and ``retain_s``
    were checked by the journal's decoder (0-100; finite and positive, or ``None``)."""
    if priority is None or priority == DEFAULT_PRIORITY:
        return None
    left = caps.max_s if retain_s is None else min(retain_s - max(0.0, age_s), caps.max_s)
    if left <= 0:
        return None
    return min(priority, caps.max_priority), left
