"""Which server a key lives on: the one server, or the cluster node that serves its slot.

A Redis Cluster splits keys into 16384 hash slots (CRC16 of the key, or of the part between
the first ``{`` and the next ``}``: the hash tag) and each primary serves ranges of them.
:class:`ClusterNodes` keeps the map (``CLUSTER SLOTS``, asked of any node it knows) and one
bounded pool per primary, so each call goes straight to its key's node. The map is reloaded
after a redirect (MOVED: a slot moved, or a replica took over) and after a failed connection
(a primary died), at most every :data:`REFRESH_EVERY_S`; until the cluster has promoted a
replica, calls for a dead primary's slots fail fast and the store counts them as misses.

A ``CLUSTER SLOTS`` reply is input from the network: it is checked (at most 16384 ranges
within the slots, ports, host names, at most :data:`MAX_NODES` primaries) before it replaces the
map, and the pools of nodes that left it are let go; a bad one is refused and the old map
kept. Redirects are never followed blindly: a MOVED reloads the map from the cluster, an ASK
is followed only to a node the map already names.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from redis.crc import key_slot
from redis.exceptions import AskError, ResponseError

log = logging.getLogger(__name__)
SLOTS = 16384
REFRESH_EVERY_S = 0.25
"""The map is reloaded at most this often, however many calls fail."""
MAX_NODES = 1000
"""Redis Cluster's recommended limit; a map naming more is refused."""
_HOST = re.compile(r"[A-Za-z0-9_.:%-]{1,253}")

Address = tuple[str, int]
MakeClient = Callable[[str, int], redis.Redis]


class BadSlotMap(ResponseError):
    """A ``CLUSTER SLOTS`` reply that is not a valid map (refused, the old one kept)."""


class NotACluster(ResponseError):
    """The server answered as it would outside the mode the tier was configured for."""


@dataclass(frozen=True)
class SlotMap:
    """Slot -> primary address (None: not served)."""

    owners: tuple[Address | None, ...]

    @property
    def primaries(self) -> list[Address]:
        return sorted({a for a in self.owners if a is not None})


def parse_slots(reply: Any, asked: Address) -> SlotMap:
    """A ``CLUSTER SLOTS`` reply as a :class:`SlotMap`; :class:`BadSlotMap` naming the
    first thing wrong. An empty or ``?`` host means the node that was asked."""
    if not isinstance(reply, list) or len(reply) > SLOTS:
        raise BadSlotMap("CLUSTER SLOTS: not a list of at most 16384 ranges")
    owners: list[Address | None] = [None] * SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise BadSlotMap("CLUSTER SLOTS: a range is not [start, end, primary, ...]")
        low, high, primary = entry[0], entry[1], entry[2]
        if not (isinstance(low, int) and isinstance(high, int) and 0 <= low <= high < SLOTS):
            raise BadSlotMap(f"CLUSTER SLOTS: range {low!r}-{high!r} is not within 0-16383")
        owners[low:high + 1] = [_address(primary, asked)] * (high - low + 1)
    if len({a for a in owners if a is not None}) > MAX_NODES:
        raise BadSlotMap(f"CLUSTER SLOTS: more than {MAX_NODES} primaries")
    return SlotMap(tuple(owners))


def _address(node: Any, asked: Address) -> Address:
    if not isinstance(node, list) or len(node) < 2:
        raise BadSlotMap("CLUSTER SLOTS: a node is not [host, port, ...]")
    host, port = node[0], node[1]
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise BadSlotMap("CLUSTER SLOTS: a node's host or port is not valid")
    if host in ("", "?"):
        host = asked[0]
    if not _HOST.fullmatch(host):
        raise BadSlotMap("CLUSTER SLOTS: a node's host name is not a host name")
    return host, port


class SingleNode:
    """One server: every key on it."""

    cluster = False

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def client_for(self, key: str) -> redis.Redis:
        return self.client

    def asking(self, exc: AskError) -> redis.Redis:
        raise NotACluster("the server redirected a key (it is a Redis Cluster node): set "
                          "the tier's option cluster: true")

    def moved(self, exc: AskError) -> None:
        self.asking(exc)

    def failed(self) -> None:
        return None

    def primaries(self) -> list[redis.Redis]:
        return [self.client]

    def close(self) -> None:
        self.client.connection_pool.disconnect()
        self.client.close()


class ClusterNodes:
    """A Redis Cluster's primaries, each with its own pool, and the slot map to pick one."""

    cluster = True

    def __init__(self, seeds: list[Address], make_client: MakeClient) -> None:
        self.seeds = seeds
        """Where to ask for the map first: the url's node and the ``nodes`` option's."""
        self.seed = seeds[0]
        self._make = make_client
        self._clients: dict[Address, redis.Redis] = {}
        self._map: SlotMap | None = None
        self._stale = True
        self._loaded_at = 0.0
        self._lock = threading.Lock()
        self._reload = threading.Lock()
        self._keeping = False

    def client_for(self, key: str) -> redis.Redis:
        slot = key_slot(key.encode())
        owner = self._current().owners[slot]
        if owner is None:
            raise redis.ConnectionError(f"no primary serves slot {slot} now (the cluster "
                                        "is down or reshaping)")
        return self._client(owner)

    def asking(self, exc: AskError) -> redis.Redis:
        """The client of an ASK's target, if the map names that node; else reload."""
        target = (str(exc.host), int(exc.port))
        if target not in self._current().primaries:
            self.moved(exc)
            raise redis.ConnectionError(f"ASK to {target[0]}:{target[1]}, a node the "
                                        "cluster's map does not name (not followed)")
        return self._client(target)

    def moved(self, exc: AskError) -> None:
        """A slot moved: reload the map before the next call (rate-limited)."""
        self._stale = True

    def failed(self) -> None:
        """A connection failed: the map may be out of date (a primary died)."""
        self._stale = True

    def primaries(self) -> list[redis.Redis]:
        return [self._client(a) for a in self._current().primaries]

    def _current(self) -> SlotMap:
        current = self._map
        due = self._stale and time.monotonic() - self._loaded_at >= REFRESH_EVERY_S
        if current is not None and not due:
            return current
        if current is not None and not self._reload.acquire(blocking=False):
            return current  # another thread reloads it: use the old one meanwhile
        if current is None:
            self._reload.acquire()
        try:
            if self._map is None:
                self._load()
            elif self._stale and time.monotonic() - self._loaded_at >= REFRESH_EVERY_S:
                self._reload_or_keep()
        finally:
            self._reload.release()
        assert self._map is not None
        return self._map

    def _reload_or_keep(self) -> None:
        """Reload the map; if no node gives a good one, keep the old (logged once a change)."""
        try:
            self._load()
        except redis.RedisError as exc:
            if not self._keeping:
                log.warning("redis cluster via %s:%d: no node gave a slot map (%s: %s); "
                            "using the last one", *self.seed, type(exc).__name__, exc)
            self._keeping = True
            return
        if self._keeping:
            log.info("redis cluster via %s:%d: slot map reloaded", *self.seed)
        self._keeping = False

    def _load(self) -> None:
        self._loaded_at = time.monotonic()
        known = [*self.seeds, *(self._map.primaries if self._map else []),
                 *self._clients]
        last: Exception | None = None
        for address in dict.fromkeys(known):
            try:
                reply = self._client(address).execute_command("CLUSTER SLOTS")
                self._map = parse_slots(reply, address)
                self._stale = False
                keep = {*self.seeds, *self._map.primaries}
                with self._lock:  # calls on a dropped pool finish; its sockets close with it
                    self._clients = {a: c for a, c in self._clients.items() if a in keep}
                return
            except ResponseError as exc:
                if "cluster support disabled" in str(exc):
                    raise NotACluster("the server is not a Redis Cluster node: set the "
                                      "tier's option cluster: false") from exc
                last = exc
            except redis.RedisError as exc:
                last = exc
        assert last is not None
        raise last

    def _client(self, address: Address) -> redis.Redis:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = self._make(*address)
            return client

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.connection_pool.disconnect()
            client.close()
