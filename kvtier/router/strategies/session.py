"""``session``: a session (the ``--session-header`` value, else the body's ``user``) always
goes to the same backend, by consistent hashing; requests without one go round robin."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.router.backends import Backend, BackendPool
from kvtier.router.request import RoutedRequest
from kvtier.router.ring import HashRing
from kvtier.router.strategies.base import Decision, RoutingContext, Strategy


class SessionAffinity(Strategy):
    name = "session"

    def __init__(self, ctx: RoutingContext) -> None:
        super().__init__(ctx)
        self.ring = PoolRing(ctx.pool)

    async def choose(self, request: RoutedRequest, candidates: Sequence[Backend]) -> Decision:
        if not request.session:
            return Decision(self.next_in_turn(candidates), "no_session")
        return (ring_pick(self.ring.now(), request.session.encode(), candidates)
                or Decision(self.next_in_turn(candidates), "rehash"))


class PoolRing:
    """A hash ring over the pool's members, rebuilt when they change (discovery): a
    newcomer takes over only its share of the keys, and one that left gives back only its
    own."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self._version = -1
        self._ring: HashRing | None = None

    def now(self) -> HashRing | None:
        """None while the pool has no member."""
        if self._version != self.pool.version:
            urls = [b.url for b in self.pool]
            self._ring = HashRing(urls) if urls else None
            self._version = self.pool.version
        return self._ring


def ring_pick(ring: HashRing | None, key: bytes, candidates: Sequence[Backend]
              ) -> Decision | None:
    """The candidate ``key`` hashes to; ``reason`` says whether it is the key's first choice
    among all backends (``hash``) or a stand-in for one that is out (``rehash``). None when
    no candidate is on the ring (they all left while the request waited)."""
    if ring is None:
        return None
    by_url = {b.url: b for b in candidates}
    url = ring.pick(key, lambda u: u in by_url)
    if url is None:
        return None
    first = ring.pick(key, lambda _u: True)
    return Decision(by_url[url], "hash" if url == first else "rehash")
