"""What the node servers hold, as far as the router already knows: lookups it need not send.

A lookup answer says, for a prompt's leading chunks, where each one is on that node server
(its tier, and when it could be in the arena) and where the held run stops. The router keeps
what each node server answered for ``ttl_s`` and adds what it did itself since:

- a prompt sent to a backend is in that backend's arena once prefilled (the connector puts
  every chunk it computes or loads there);
- and in every *shared* tier of that node server, so on every other node server that names
  the same shared tier in its answers (each answer lists its server's shared tiers): another
  instance loads it from there, at the pace that node server's last answer showed for that
  tier. A lower tier's pace is its queue's (each answer's arrivals count the reads queued
  there), which changes as fast as requests come and go: it stands for :data:`PACE_S` only.
  A node server that has not answered within it is asked again in the background (about one
  lookup per node server a second, however many decisions) while the decision goes on with
  the pace it has, up to :data:`STALE_PACE_S` old; older than that, the decision waits for
  the answer. A decision therefore seldom waits for a node server on a busy fleet, and never
  uses a pace much older than a second there: the one learned in a quiet moment is renewed
  before it can move many conversations.

From this, :meth:`Holdings.recall` answers a lookup without sending it when the router's
knowledge reaches as far as an answer would: walking the prompt's chunks, each is remembered
at that node server until one it does not hold (an answer's end), or the prompt's end, or a
chunk no node server was ever told about or answered holding (the new text of this turn: no
answer could hold it either). A chunk the router knows some node server held, but not what
this one holds of it (its memory expired, or it was never asked), is asked as before. So is
everything after a restart: an empty memory recalls nothing.

What is recalled can be stale: the arena evicts, another router's backends write, a node
server restarts. It costs the routing, never a wrong block (the engine loads only what its
node server leases it); :meth:`contradicted` forgets a node server's memory of a prompt when a
response shows fewer held tokens than was predicted from it, and the next decision asks.

Bounded: each node server's memory keeps at most ``max_keys`` chunks and the fleet-wide set
of chunks told about at most ``4 * max_keys``, least recently used first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.keys import ChunkKey

Answer = tuple[tuple[str, ...], tuple[float, ...]]
ARENA = "arena"
MAX_SHARED = 8
"""At most this many shared tier names are kept from one answer (more are a broken or
hostile node server)."""
MAX_NAME = 64
PACE_S = 1.0
"""How long a node server's pace for a tier below the arena (seconds a chunk, as its last
answer with chunks there gave them) stands for the arrivals of recalled chunks there."""
STALE_PACE_S = 10.0
"""How old a pace may still answer a decision while that node server is asked again in the
background (:attr:`Recalled.due`); an older one is asked and waited for."""
DEFAULT_MAX_KEYS = 1 << 17
"""Chunks remembered per node server by default: ~3,700 conversations of 35 chunks."""


@dataclass(frozen=True)
class Recalled:
    """What memory answers of a decision's lookups."""

    answers: dict[tuple[str, bytes], Answer]
    due: frozenset[tuple[str, bytes]] = frozenset()
    """Those of :attr:`answers` given at a pace older than :data:`PACE_S`: to be asked
    again in the background, not waited for."""


@dataclass
class Node:
    """One node server as remembered: chunk key -> (tier or None: not held, when learned)."""

    chunks: OrderedDict[ChunkKey, tuple[str | None, float]] = field(default_factory=OrderedDict)
    shared: frozenset[str] = frozenset()
    per_chunk_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per tier below the arena, the seconds its last answer with chunks there gave each
    (the last one's arrival over their count), and when: the arrivals of recalled chunks,
    for :data:`PACE_S`."""


class Holdings:
    def __init__(self, ttl_s: float, max_keys: int = DEFAULT_MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max(1, max_keys)
        self.clock = clock
        self._nodes: dict[str, Node] = {}
        self._told: OrderedDict[ChunkKey, None] = OrderedDict()
        """Chunks some node server answered holding, or the router sent: no TTL, so that a
        conversation back after a pause is asked about, not taken for new text."""

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    # ------------------------------------------------------------------ learning

    def learn(self, url: str, keys: Sequence[ChunkKey], answer: Answer,
              shared: Iterable[str] | None = None, asked_at: float | None = None) -> None:
        """A node server's answer for ``keys`` (its held run, then the first chunk it does
        not hold), and the shared tiers it named (None: not said, the last kept).
        ``asked_at`` (this memory's clock): what the router learned after the lookup left —
        a prompt it sent meanwhile, whose answer was not waited for — is newer, and kept."""
        if not self.enabled:
            return
        node = self._nodes.setdefault(url, Node())
        if shared is not None:
            node.shared = frozenset(shared)
        tiers, arrivals = answer
        now = self.clock()
        since = now if asked_at is None else asked_at
        runs: dict[str, tuple[int, float]] = {}
        for key, tier, arrival in zip(keys, tiers, arrivals, strict=False):
            if not self._newer(node, key, since):
                self._put(node, key, tier, now)
            self._tell(key)
            if tier != ARENA:
                count, latest = runs.get(tier, (0, 0.0))
                runs[tier] = (count + 1, max(latest, arrival))
        stop = keys[len(tiers)] if len(tiers) < len(keys) else None
        if stop is not None and stop not in keys[:len(tiers)] and not self._newer(
                node, stop, since):
            self._put(node, stop, None, now)
        for tier, (count, latest) in runs.items():
            node.per_chunk_s[tier] = (latest / count, now)
        self._trim(node)

    def sent(self, url: str, keys: Sequence[ChunkKey]) -> None:
        """The router sent a prompt with ``keys`` to the backend of node server ``url``."""
        if not self.enabled or not keys:
            return
        node = self._nodes.setdefault(url, Node())
        now = self.clock()
        for key in keys:
            self._put(node, key, ARENA, now)
            self._tell(key)
        self._trim(node)
        for other_url, other in self._nodes.items():
            common = sorted(node.shared & other.shared)
            if other_url == url or not common:
                continue
            for key in keys:
                held = other.chunks.get(key)
                if (held is None or held[0] in (None, common[0])
                        or now - held[1] > self.ttl_s):
                    self._put(other, key, common[0], now)
            self._trim(other)

    def contradicted(self, url: str, keys: Sequence[ChunkKey]) -> None:
        """A response held fewer tokens than predicted: what ``url`` holds of ``keys`` is
        asked again next time."""
        node = self._nodes.get(url)
        if node is not None:
            for key in keys:
                node.chunks.pop(key, None)

    def forget(self, url: str) -> None:
        """The node server (or its backend) went away: its arena is gone."""
        self._nodes.pop(url, None)

    def keep(self, urls: Iterable[str]) -> None:
        """Forget every node server but ``urls`` (the backends' set changed; an answer that
        came in late from one that left is dropped here too)."""
        kept = set(urls)
        for url in [u for u in self._nodes if u not in kept]:
            del self._nodes[url]

    # ------------------------------------------------------------------ recalling

    def recall(self, url: str, keys: Sequence[ChunkKey]) -> Answer | None:
        """The answer ``url`` would give for ``keys``, if the router already knows it (with
        every lower tier's pace answered within :data:`PACE_S`)."""
        known = self._recall(url, keys)
        return None if known is None or known[1] > PACE_S else known[0]

    def recall_all(self, asks: Mapping[tuple[str, bytes], Sequence[ChunkKey]]) -> Recalled:
        """Those of ``asks`` (node server URL, namespace) -> keys the router can answer,
        at a pace up to :data:`STALE_PACE_S` old; those whose pace is older than
        :data:`PACE_S` are :attr:`Recalled.due`."""
        out: dict[tuple[str, bytes], Answer] = {}
        due: set[tuple[str, bytes]] = set()
        for ask, keys in asks.items():
            known = self._recall(ask[0], keys)
            if known is None or known[1] > STALE_PACE_S:
                continue
            out[ask] = known[0]
            if known[1] > PACE_S:
                due.add(ask)
        return Recalled(out, frozenset(due))

    def _recall(self, url: str, keys: Sequence[ChunkKey]) -> tuple[Answer, float] | None:
        """The answer ``url`` would give for ``keys`` and the age of the oldest lower tier
        pace in it (0 when it has none), or None when memory cannot say."""
        node = self._nodes.get(url)
        if not self.enabled or node is None:
            return None
        now = self.clock()
        oldest = now - self.ttl_s
        tiers: list[str] = []
        arrivals: list[float] = []
        runs: dict[str, int] = {}
        age = 0.0
        for key in keys:
            held = node.chunks.get(key)
            if held is None or held[1] < oldest:
                if key in self._told:
                    return None  # some node server holds it: ask this one
                break  # nobody was told about it: nobody holds it
            tier = held[0]
            if tier is None:
                break
            node.chunks.move_to_end(key)
            tiers.append(tier)
            if tier == ARENA:
                arrivals.append(0.0)
                continue
            pace = node.per_chunk_s.get(tier)
            if pace is None:
                return None  # how fast it reads there was never answered: ask
            age = max(age, now - pace[1])
            runs[tier] = runs.get(tier, 0) + 1
            arrivals.append(runs[tier] * pace[0])
        return (tuple(tiers), tuple(arrivals)), age

    def size(self, url: str) -> int:
        node = self._nodes.get(url)
        return 0 if node is None else len(node.chunks)

    # ------------------------------------------------------------------ bounds

    @staticmethod
    def _newer(node: Node, key: ChunkKey, than: float) -> bool:
        held = node.chunks.get(key)
        return held is not None and held[1] > than

    def _put(self, node: Node, key: ChunkKey, tier: str | None, now: float) -> None:
        node.chunks[key] = (tier, now)
        node.chunks.move_to_end(key)

    def _tell(self, key: ChunkKey) -> None:
        self._told[key] = None
        self._told.move_to_end(key)

    def _trim(self, node: Node) -> None:
        while len(node.chunks) > self.max_keys:
            node.chunks.popitem(last=False)
        while len(self._told) > 4 * self.max_keys:
            self._told.popitem(last=False)


def shared_tiers(doc: object) -> list[str] | None:
    """The ``shared`` list of a lookup answer: None when absent or not a list of at most
    :data:`MAX_SHARED` short names (an older node server, or nonsense)."""
    if not isinstance(doc, list) or len(doc) > MAX_SHARED:
        return None
    if not all(isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in doc):
        return None
    return [str(n) for n in doc]
