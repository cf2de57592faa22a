"""``session``: a session (the ``--session-header`` value, else the body's ``user``) always
goes to the same backend, by consistent hashing; requests without one go round robin."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.router.backends import Backend
from kvtier.router.request import RoutedRequest
from kvtier.router.ring import HashRing
from kvtier.router.strategies.base import Decision, RoutingContext, Strategy


class SessionAffinity(Strategy):
    name = "session"

    def __init__(self, ctx: RoutingContext) -> None:
        super().__init__(ctx)
        self.ring = HashRing([b.url for b in ctx.pool])

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        if not request.session:
            return Decision(self.next_in_turn(candidates), "no_session")
        return ring_pick(self.ring, request.session.encode(), candidates)


def ring_pick(ring: HashRing, key: bytes, candidates: Sequence[Backend]) -> Decision:
    """The candidate ``key`` hashes to; ``reason`` says whether it is the key's first choice
    among all backends (``hash``) or a stand-in for one that is out (``rehash``)."""
    by_url = {b.url: b for b in candidates}
    url = ring.pick(key, lambda u: u in by_url)
    assert url is not None, "candidates is never empty"
    first = ring.pick(key, lambda _u: True)
    return Decision(by_url[url], "hash" if url == first else "rehash")
