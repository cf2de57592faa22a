"""The lease table: open leases by id, by owner and by deadline, and who waits on what.

A lease names the chunks a client reads, each in an arena slot. Items of chunks that were
in the arena are READY (their slot is pinned by the lease); items of chunks being promoted
from a lower tier are PENDING and listed under their key, so a finished promotion reaches
exactly its waiters::

    waiting[key] ──► [LeaseItem, ...]    PENDING items of open leases (closed ones turn
                                           FAILED and are skipped when the promotion ends)

Pinning and unpinning slots is the arena's business: the table only says which items of a
closed lease were READY (the caller unpins those).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from kvtier.errors import IntegrityError, InvalidRequest
from kvtier.keys import ChunkKey
from kvtier.store.holdings import Holdings
from kvtier.store.records import ItemState, LeaseItem, LeaseRecord


class LeaseTable:
    def __init__(self) -> None:
        self._records: dict[int, LeaseRecord] = {}
        self.holdings: Holdings[int] = Holdings()
        self._waiting: dict[ChunkKey, list[LeaseItem]] = {}
        self._ids = itertools.count(1)

    def open(self, owner: int, items: list[LeaseItem], deadline: float) -> LeaseRecord:
        record = LeaseRecord(next(self._ids), owner, items)
        self._records[record.lease_id] = record
        self.holdings.add(record.lease_id, owner, deadline)
        for item in items:
            if item.state is ItemState.PENDING:
                self._waiting.setdefault(item.key, []).append(item)
        return record

    def get(self, lease_id: int, owner: int | None = None) -> LeaseRecord:
        """The open lease ``lease_id`` of ``owner`` (any, for ``None``)."""
        record = self._records.get(lease_id)
        if record is None or owner not in (None, record.owner):
            raise InvalidRequest(f"no open lease {lease_id} of this client (released, "
                                 "expired or never granted)")
        return record

    def close(self, lease_id: int) -> LeaseRecord:
        """End a lease; its READY items are the caller's to unpin, PENDING ones turn FAILED."""
        record = self._records.pop(lease_id)
        self.holdings.remove(lease_id)
        record.closed = True
        for item in record.items:
            if item.state is ItemState.PENDING:
                item.state = ItemState.FAILED
        return record

    def expired(self, now: float, limit: int | None = None) -> list[LeaseRecord]:
        """Close and return the leases past their deadline (at most ``limit``)."""
        out = []
        for lease_id in self.holdings.expired(now, limit):
            out.append(self.close(lease_id))
        return out

    def renew(self, lease_id: int, deadline: float) -> None:
        self.holdings.renew(lease_id, deadline)

    def waiters(self, key: ChunkKey) -> list[LeaseItem]:
        """The PENDING items of open leases waiting for ``key`` (removed from the table)."""
        return [item for item in self._waiting.pop(key, ())
                if item.state is ItemState.PENDING]

    def ready_items(self) -> Iterator[LeaseItem]:
        for record in self._records.values():
            for item in record.items:
                if item.state is ItemState.READY:
                    yield item

    def check_integrity(self) -> None:
        self.holdings.check_integrity("lease table")
        if set(self._records) != set(self.holdings):
            raise IntegrityError("lease table: records and holdings disagree")
        for record in self._records.values():
            for item in record.items:
                if (item.state is ItemState.PENDING
                        and not any(w is item for w in self._waiting.get(item.key, ()))):
                    raise IntegrityError(f"lease {record.lease_id}: a pending item of "
                                         f"{item.key.hex()[:16]} waits on nothing")

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._records

    def __iter__(self) -> Iterator[int]:
        return iter(self._records)
