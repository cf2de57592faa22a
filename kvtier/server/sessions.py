"""Client sessions: ownership that survives a reconnect.

A client sends a random session token in every hello. All connections carrying one token
act for one owner in the store, so a client whose connection dropped (a timeout, a server
thread that closed it) reconnects and still commits its reservations and releases its
leases. When a session's last connection closes, the store starts the owner's grace period
(:meth:`TieredStore.drop_owner`); a connection that comes back within it resumes the
owner (:meth:`TieredStore.resume_owner`). Sessions idle longer than the grace are forgotten
(by then everything they held has expired). An empty token is a session of its own per
connection (older clients, tools).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.store import TieredStore


@dataclass
class _Session:
    owner: int
    connections: int = 0
    left_at: float = 0.0


class Sessions:
    def __init__(self, store: TieredStore, grace_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.grace_s = grace_s
        self.clock = clock
        self._by_token: dict[str, _Session] = {}
        self._owners = itertools.count(1)
        self._lock = threading.Lock()

    def attach(self, token: str) -> int:
        """A connection presents ``token``: the owner it acts for."""
        with self._lock:  # held across the store call: a detach cannot overtake it
            session = self._by_token.get(token) if token else None
            if session is None:
                session = _Session(next(self._owners))
                if token:
                    self._by_token[token] = session
            elif session.connections == 0:
                self.store.resume_owner(session.owner)
            session.connections += 1
            return session.owner

    def detach(self, token: str, owner: int) -> None:
        """A connection of ``token`` closed."""
        with self._lock:
            session = self._by_token.get(token) if token else None
            if session is not None:
                session.connections -= 1
                if session.connections > 0:
                    return
                session.left_at = self.clock()
            self.store.drop_owner(owner)

    def forget_idle(self) -> None:
        """Drop sessions without a connection for longer than the grace period."""
        cutoff = self.clock() - self.grace_s - 1.0
        with self._lock:
            for token in [t for t, s in self._by_token.items()
                          if s.connections == 0 and s.left_at < cutoff]:
                del self._by_token[token]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)
