"""Which prefixes the router sent where: its estimate of each backend's device cache.

vLLM's own prefix cache (device hits) cannot be asked from outside, and its block hashes
are not reproducible outside the engine, so the router remembers the chunk keys of the
prompts it sent to each backend. A key counts as held for ``ttl_s`` after its last use, and
each backend keeps at most as many keys as its device cache has chunks (vLLM's
``cache_config_info`` blocks x block size, or a default), least recently sent first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.keys import ChunkKey


class DeviceHistory:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._sent: dict[int, OrderedDict[ChunkKey, float]] = {}

    def held(self, backend: int, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the backend's device cache should still hold."""
        sent = self._sent.get(backend)
        if not sent:
            return 0
        oldest = self.clock() - self.ttl_s
        n = 0
        for key in keys:
            at = sent.get(key)
            if at is None or at < oldest:
                break
            n += 1
        return n

    def record(self, backend: int, keys: Sequence[ChunkKey], capacity_chunks: int) -> None:
        sent = self._sent.setdefault(backend, OrderedDict())
        now = self.clock()
        for key in keys:
            sent[key] = now
            sent.move_to_end(key)
        while len(sent) > max(1, capacity_chunks):
            sent.popitem(last=False)

    def forget(self, backend: int) -> None:
        self._sent.pop(backend, None)

    def size(self, backend: int) -> int:
        return len(self._sent.get(backend, ()))
