"""A consistent-hash ring with virtual nodes.

Each member is placed at ``vnodes`` points (sha256 of ``"<member>#<i>"``); a key goes to the
first point clockwise from its own hash whose member is allowed. A member that leaves (a dead
backend) only moves its own keys, to the members that follow its points; when it comes back
its keys return to it.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence


def point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class HashRing:
    def __init__(self, members: Sequence[str], vnodes: int = 100) -> None:
        if not members:
            raise ValueError("a hash ring needs at least one member")
        placed = sorted((point(f"{m}#{i}".encode()), m) for m in members for i in range(vnodes))
        self._points = [p for p, _ in placed]
        self._members = [m for _, m in placed]

    def pick(self, key: bytes, allowed: Callable[[str], bool]) -> str | None:
        """The member ``key`` maps to among those ``allowed`` accepts (None if none does)."""
        n = len(self._points)
        start = bisect.bisect(self._points, point(key))
        seen: set[str] = set()
        for step in range(n):
            member = self._members[(start + step) % n]
            if member in seen:
                continue
            if allowed(member):
                return member
            seen.add(member)
        return None
