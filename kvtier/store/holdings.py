"""What each client holds, and until when: the books behind leases and reservations.

Every item (a lease id, a reserved key) has one owner (a client session) and one deadline.
Indexed both ways, so that expiring, dropping or resuming a client costs what that client
holds, not what the store holds::

    owner ──► {items}            (a client went away: cap its deadlines to the grace period)
    item  ──► owner, deadline    (deadline-ordered: housekeeping pops only what expired)
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from kvtier.errors import IntegrityError
from kvtier.store.deadlines import Deadlines

T = TypeVar("T", bound=Hashable)


class Holdings(Generic[T]):
    def __init__(self) -> None:
        self._owner: dict[T, int] = {}
        self._by_owner: dict[int, set[T]] = {}
        self._deadlines: Deadlines[T] = Deadlines()

    def add(self, item: T, owner: int, deadline: float) -> None:
        if item in self._owner:
            raise KeyError(f"{item!r} is already held")
        self._owner[item] = owner
        self._by_owner.setdefault(owner, set()).add(item)
        self._deadlines.set(item, deadline)

    def remove(self, item: T) -> None:
        owner = self._owner.pop(item, None)
        if owner is None:
            return
        held = self._by_owner[owner]
        held.discard(item)
        if not held:
            del self._by_owner[owner]
        self._deadlines.discard(item)

    def owner_of(self, item: T) -> int | None:
        return self._owner.get(item)

    def held_by(self, item: T, owner: int | None) -> bool:
        """``item`` is held, by ``owner`` (by anyone, for ``None``: in-process callers)."""
        holder = self._owner.get(item)
        return holder is not None and owner in (None, holder)

    def items_of(self, owner: int) -> list[T]:
        return list(self._by_owner.get(owner, ()))

    def renew(self, item: T, deadline: float) -> None:
        if item in self._owner:
            self._deadlines.set(item, deadline)

    def cap_owner(self, owner: int, deadline: float) -> None:
        """No item of ``owner`` lives past ``deadline`` (its client went away)."""
        for item in self._by_owner.get(owner, ()):
            current = self._deadlines.get(item)
            if current is None or current > deadline:
                self._deadlines.set(item, deadline)

    def renew_owner(self, owner: int, deadline: float) -> None:
        """Every item of ``owner`` lives until ``deadline`` (its client came back)."""
        for item in self._by_owner.get(owner, ()):
            self._deadlines.set(item, deadline)

    def expired(self, now: float, limit: int | None = None) -> list[T]:
        """The items past their deadline (at most ``limit``), removed from the books."""
        items = self._deadlines.pop_expired(now, limit)
        for item in items:
            self.remove(item)
        return items

    def deadline(self, item: T) -> float | None:
        return self._deadlines.get(item)

    def check_integrity(self, what: str) -> None:
        """Both indexes and the deadlines agree; raises IntegrityError naming ``what``."""
        flat = {item for items in self._by_owner.values() for item in items}
        if flat != set(self._owner) or set(self._deadlines) != set(self._owner):
            raise IntegrityError(f"{what}: owner index, item index and deadlines disagree")
        if any(not items for items in self._by_owner.values()):
            raise IntegrityError(f"{what}: an owner is listed with nothing held")

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, item: object) -> bool:
        return item in self._owner

    def __iter__(self) -> Iterator[T]:
        return iter(self._owner)
