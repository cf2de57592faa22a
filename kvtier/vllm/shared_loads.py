"""Loads in flight in this engine, so that requests for the same prefix share one.

Sub-agents spawned together send their parent's context N times at once. The first request's
lookup leases the chain (the node server reads each chunk from its tier once, and later
leases join that read) and its load starts; every other request would lease it too and copy
the same chunks into KV blocks of its own: N copies into N times the KV cache. Instead, a
request whose next chunk (the first beyond vLLM's own prefix hit) is being loaded for another
request is told "not yet": vLLM keeps it waiting and asks again next step. Once the load has
landed, vLLM's prefix cache holds those blocks and the request's own prefix hit covers them::

    loading[key] -> request       the chunks of each load in flight (from lease to landing)
    waiting[request] -> since     requests told "not yet", and since when

A request waits at most ``wait_s`` (then it looks up and loads on its own, joining the node
server's read), and not at all for a load that failed or ended: the chunks it could not serve
are looked up again (a miss: recomputed). The table holds the chunks of loads in flight only,
which vLLM's KV cache bounds. Pointless without vLLM's prefix caching: the facade turns it off.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.keys import ChunkKey


class SharedLoads:
    def __init__(self, wait_s: float, enabled: bool = True) -> None:
        self.wait_s = wait_s
        self.enabled = enabled
        self._loading: dict[ChunkKey, str] = {}
        self._keys: dict[str, list[ChunkKey]] = {}
        self._waiting: dict[str, float] = {}

    def started(self, req_id: str, keys: Iterable[ChunkKey]) -> None:
        """``req_id``'s load of ``keys`` is in flight (a key loaded already stays its first
        loader's)."""
        if not self.enabled:
            return
        mine = [k for k in keys if self._loading.setdefault(k, req_id) == req_id]
        if mine:
            self._keys.setdefault(req_id, []).extend(mine)

    def ended(self, req_id: str) -> None:
        """``req_id``'s load landed, failed or was dropped; also: the request is gone."""
        for key in self._keys.pop(req_id, ()):
            if self._loading.get(key) == req_id:
                del self._loading[key]
        self._waiting.pop(req_id, None)

    def wait(self, req_id: str, key: ChunkKey, now: float) -> bool | None:
        """Whether ``req_id`` should wait for another request's load of ``key``: ``None``
        for no, ``True`` for its first wait, ``False`` for a later one. A request waits
        ``wait_s`` in all, however many loads it waits for."""
        owner = self._loading.get(key)
        if owner is None or owner == req_id:
            return None
        since = self._waiting.get(req_id)
        if since is None:
            self._waiting[req_id] = now
            return True
        if now - since >= self.wait_s:
            return None  # waited long enough: on its own (the server's read is shared)
        return False

    def __len__(self) -> int:
        return len(self._loading)
