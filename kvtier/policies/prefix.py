"""Prefix-aware eviction: chains leave tail first, and chains that came back stay longer.

A KV chunk is useful only behind every chunk before it, so this order never names a chunk
while a chunk after it (its *child*, inserted with ``parent=``) is still here: only leaves
are victims, and a parent becomes one when its last child has left. A chain therefore drains
from its tail, and a shared head (a system prompt) stays while any extension of it does::

    a ── b ── c ── d        leaves: d, f (victims, lowest score first)
          \\
           e ── f           b waits for c and e; a waits for b

Each chunk's score is the step of its last use (an insert or a hit; one step per use), plus
``reuse_bonus`` x capacity steps for each time its chain came back (up to ``levels``, default
one: came back or not); the lowest score leaves first. A chain came back when:

* a chunk is hit (a conversation's next turn, a shared prompt);
* a chunk is stored again while its name is still among the ``ghosts`` x capacity last
  evicted ones (it came back after the tier had already given it up: the common case when
  the cycle of users is longer than the tier);
* a chunk is appended after a parent that came back and has at most ``branches`` other kids
  (the next part of a returning conversation; the other kid is usually the partial last
  block of the previous turn). A branch off a head many chains share (a new conversation on
  a popular system prompt) earns nothing, so one-time prompts drain first.

Chunks are inserted tail first, so a kid usually arrives before its parent: it waits under
the parent's name (and counts as unreachable, :attr:`PrefixAware.waiting`) until the parent
is stored, and a mark on the parent reaches the fresh kids already there.

Without ``parent`` hints every chunk is a root and this is LRU with a bonus for chunks that
were hit or came back from the ghosts. Costs: O(log n) per insert, hit and eviction (one heap
of leaves, stale entries skipped lazily and compacted when they outnumber live ones); the
walk that marks a continued chain's fresh kids visits each chunk at most once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic

from kvtier.errors import IntegrityError
from kvtier.policies.base import Algorithm, K

REUSE_BONUS = 3.0
"""Extra life of a chunk whose chain came back, in multiples of the tier's capacity in uses."""
GHOSTS = 3.0
"""Names of evicted chunks remembered, in multiples of the capacity: one stored again was
asked for again, so it counts as a chain that came back."""
LEVELS = 1
"""Hits told apart: a chunk hit ``level`` times (up to this) earns ``level`` bonuses."""
BRANCHES = 1
"""A chunk appended after a parent with at most this many other kids continues that parent's
chain (the other kid is a partial last block the next turn replaced); more is a branch."""


class _Node(Generic[K]):
    __slots__ = ("fresh", "hint", "kids", "level", "used")

    def __init__(self, hint: K | None, used: int) -> None:
        self.hint = hint
        """The parent as given; the node hangs under it while it is present."""
        self.kids: set[K] | None = None
        self.used = used
        self.level = 0
        """How often its chain came back (hits; a ghost or a chain it continues counts as
        one), up to ``levels``: it earns ``level`` bonuses and waits in list ``level``."""
        self.fresh = True
        """Never hit: the chain it joins may still mark it reused."""


class PrefixAware(Algorithm[K]):
    """See the module docstring. Leaves wait in one list per level, oldest use first; the
    scores of list ``i`` all carry ``i`` bonuses, so the lowest score is at the head of one
    of them and every step is O(levels)::

        level 0  d(4) f(7) ...        victim: the lowest of 4, 2 + bonus, ...
        level 1  x(2) y(9) ...        a parent whose last kid left joins its list's head

    A parent that becomes a leaf goes to the head of its list (its chain is draining)
    rather than to its exact place by score: its kids were used just before it."""

    def __init__(self, capacity: int, reuse_bonus: float = REUSE_BONUS,
                 ghosts: float = GHOSTS, branches: int = BRANCHES, levels: int = LEVELS) -> None:
        super().__init__(capacity)
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._ghost_limit = int(ghosts * self.capacity)
        self._branches = branches
        self._bonus = int(reuse_bonus * self.capacity)
        self._nodes: dict[K, _Node[K]] = {}
        self._waiting: dict[K, set[K]] = {}
        """Present keys by their absent parent (tail-first inserts meet kids first)."""
        self._top = max(1, levels)
        self._lists: list[OrderedDict[K, None]] = [OrderedDict() for _ in range(self._top + 1)]
        self._step = 0

    @property
    def waiting(self) -> int:
        """Present keys whose parent is absent: unreachable through this tier alone."""
        return sum(len(kids) for kids in self._waiting.values())

    def insert(self, key: K) -> None:
        self._add(key, None)

    def insert_after(self, key: K, parent: K) -> None:
        self._add(key, parent)

    def _add(self, key: K, hint: K | None) -> None:
        self._step += 1
        node: _Node[K] = _Node(hint, self._step)
        nodes = self._nodes
        nodes[key] = node
        node.kids = self._waiting.pop(key, None)
        if hint is not None and (hint == key or (node.kids and self._below(hint, key))):
            node.hint = hint = None  # a loop: only keys that are not chained can make one
        if hint is not None:
            up = nodes.get(hint)
            if up is None:
                self._waiting.setdefault(hint, set()).add(key)
            else:
                if up.kids is None:
                    up.kids = set()
                    self._unlist(hint, up)
                up.kids.add(key)
                if up.level and len(up.kids) <= self._branches + 1:
                    self._mark(node, up.level)
        if key in self._ghost:
            del self._ghost[key]
            self._mark(node, 1)
        if not node.kids:
            self._lists[node.level][key] = None

    def _below(self, key: K, top: K) -> bool:
        """True if ``top`` is an ancestor of present ``key``. Asked only when an insert
        both adopts waiting kids and names a parent: at most once per commit it matters."""
        node = self._nodes.get(key)
        while node is not None and node.hint is not None:
            if node.hint == top:
                return True
            node = self._nodes.get(node.hint)
        return False

    def _mark(self, node: _Node[K], level: int) -> None:
        """A node not yet listed joins a chain that came back: it and its fresh
        descendants (inserted tail first, before it) rise to ``level``. A fresh node only
        rises, at most ``levels`` times, so the walk costs O(1) per insert, amortized."""
        if node.level >= level:
            return
        node.level = level
        stack = list(node.kids or ())
        while stack:
            kid_key = stack.pop()
            kid = self._nodes[kid_key]
            if not kid.fresh or kid.level >= level:
                continue
            if kid.kids:
                stack.extend(kid.kids)
            else:
                del self._lists[kid.level][kid_key]
                self._lists[level][kid_key] = None
            kid.level = level

    def _unlist(self, key: K, node: _Node[K]) -> None:
        """Take a leaf out of its list (it gained a kid, left, or moves)."""
        del self._lists[node.level][key]

    def touch(self, key: K) -> None:
        self._step += 1
        node = self._nodes[key]
        node.used = self._step
        node.fresh = False
        level = min(self._top, node.level + 1)
        if not node.kids:
            self._unlist(key, node)
            self._lists[level][key] = None
        node.level = level

    def remove(self, key: K) -> None:
        self._drop(key)

    def evicted(self, key: K) -> None:
        self._drop(key)
        if self._ghost_limit:
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_limit:
                self._ghost.popitem(last=False)

    def _drop(self, key: K) -> None:
        node = self._nodes.pop(key)
        if node.kids:
            self._waiting[key] = node.kids
        else:
            self._unlist(key, node)
        hint = node.hint
        if hint is None:
            return
        up = self._nodes.get(hint)
        if up is None:
            waiting = self._waiting[hint]
            waiting.discard(key)
            if not waiting:
                del self._waiting[hint]
        elif up.kids is not None:
            up.kids.discard(key)
            if not up.kids:
                up.kids = None
                queue = self._lists[up.level]
                queue[hint] = None
                queue.move_to_end(hint, last=False)

    def victims(self) -> Iterator[K]:
        return self.victims_for(_never)

    def victims_for(self, protected: Callable[[K], bool]) -> Iterator[K]:
        """The lists merged by score, without changing them. A parent whose kids were all
        yielded is next at the head of its list (a stack per list, as ``_drop`` puts it
        there). The first victim is read off the heads alone: most callers want one."""
        first: K | None = None
        first_score = 0
        for side, queue in enumerate(self._lists):
            if queue:
                key = next(iter(queue))
                score = self._nodes[key].used + self._bonus * side
                if first is None or score < first_score:
                    first, first_score = key, score
        if first is None:
            return
        if protected(first):
            yield from self._walk(protected, None)
        else:
            yield first
            yield from self._walk(protected, first)

    def _walk(self, protected: Callable[[K], bool], taken: K | None) -> Iterator[K]:
        """The merge of :meth:`victims_for`; ``taken``, its first pick, was yielded."""
        nodes, bonus = self._nodes, self._bonus
        sides = range(len(self._lists))
        lists = [iter(q) for q in self._lists]
        front: list[list[K]] = [[] for _ in sides]
        heads: list[K | None] = [_next(it) for it in lists]
        gone: dict[K, int] = {}
        while True:  # one step per victim: the list whose head scores lower
            best, best_score = -1, 0
            for side in sides:
                key = front[side][-1] if front[side] else heads[side]
                if key is not None:
                    score = nodes[key].used + bonus * side
                    if best < 0 or score < best_score:
                        best, best_score = side, score
            if best < 0:
                return
            if front[best]:
                key = front[best].pop()
            else:
                key = heads[best]
                heads[best] = _next(lists[best])
            assert key is not None
            if key == taken:
                taken = None
            elif protected(key):
                continue
            else:
                yield key
            parent = nodes[key].hint
            up = nodes.get(parent) if parent is not None else None
            if parent is not None and up is not None and up.kids is not None:
                left = gone[parent] = gone.get(parent, 0) + 1
                if left == len(up.kids):
                    front[up.level].append(parent)

    def check_integrity(self) -> None:
        """Raise IntegrityError if parent and kid links disagree or a leaf is not ordered."""
        for key, node in self._nodes.items():
            if node.hint is not None:
                up = self._nodes.get(node.hint)
                held = self._waiting.get(node.hint, set()) if up is None else up.kids or set()
                if key not in held:
                    raise IntegrityError("prefix policy: a chunk's parent does not list it")
            for kid in node.kids or ():
                if self._nodes[kid].hint != key:
                    raise IntegrityError("prefix policy: a kid names another parent")
            if key in self._waiting or node.kids == set():
                raise IntegrityError("prefix policy: a present chunk waits or has empty kids")
        for parent, kids in self._waiting.items():
            if not kids or any(self._nodes[k].hint != parent for k in kids):
                raise IntegrityError("prefix policy: a waiting chunk names another parent")
        leaves = {k for k, n in self._nodes.items() if not n.kids}
        listed = {k for q in self._lists for k in q}
        if listed != leaves or len(listed) != sum(len(q) for q in self._lists):
            raise IntegrityError("prefix policy: the leaf lists and the leaves disagree")
        if any(self._nodes[k].level != level for level, q in enumerate(self._lists) for k in q):
            raise IntegrityError("prefix policy: a leaf waits in the wrong list")
        if len(self._ghost) > self._ghost_limit or self._ghost.keys() & self._nodes.keys():
            raise IntegrityError("prefix policy: ghosts outgrow their bound or are present")

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes


def _never(key: object) -> bool:
    return False


def _next(keys: Iterator[K]) -> K | None:
    return next(keys, None)
