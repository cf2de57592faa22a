"""The redis tier's notes (journal records, heartbeats): ``P n:{P n}:<name>`` values and the
``P nz:{P n}`` name index, both on one slot (:mod:`~kvtier.tiers.redis_layout`), so a note and
its name are written and deleted in one MULTI/EXEC and listed in order with ZRANGEBYLEX. A
value of another type under the name index's key is replaced when a write or delete meets it
(:mod:`~kvtier.tiers.redis_repair`)."""

from __future__ import annotations

from typing import cast

import redis
from redis.exceptions import ResponseError

from kvtier.errors import NoteTooLarge
from kvtier.tiers.redis_index import is_wrongtype, note_member
from kvtier.tiers.redis_layout import Layout
from kvtier.tiers.redis_routes import BATCH, Routes
from kvtier.tiers.shared import MAX_LISTED_NOTES, MAX_NOTE_BYTES, check_note_name
from kvtier.tiers.skips import Skips


class Notes:
    def __init__(self, tier: str, routes: Routes, layout: Layout, skips: Skips) -> None:
        self.tier = tier
        self.routes = routes
        self.layout = layout
        self.skips = skips

    def put(self, name: str, data: bytes) -> None:
        key = self.layout.note(check_note_name(name))
        notes = self.layout.notes
        self.routes.exec_typed(key, f"writing note {name}", [
            (b"SET", key, data), (b"ZADD", notes, 0, name)], {notes: "zset"})

    def get(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        key = self.layout.note(check_note_name(name))
        found = self.routes.bounded_get(key, max_bytes, f"reading note {name}", exists=True)
        if found is None:
            return None
        if found.size > max_bytes:
            raise NoteTooLarge(f"redis tier {self.tier}: note {name} holds {found.size} bytes, "
                               f"more than the {max_bytes} a note may (not read)")
        return found.data

    def names(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        """The first ``limit`` valid note names under ``prefix`` (at any depth), in order;
        members of the name index that are not note names are skipped and counted."""
        folder = check_note_name(prefix.rstrip("/")) + "/"
        low = b"(" + start_after.encode() if start_after >= folder else b"[" + folder.encode()
        high = f"({folder[:-1]}0"  # '0' follows '/': the end of the folder's range
        names: list[str] = []
        while len(names) < limit:
            want = min(limit - len(names), BATCH * 8)
            page = self._range(f"listing notes {prefix}", low, high, want)
            valid = [n for n in map(note_member, page) if n is not None and n > start_after]
            self.skips.add("note names that are not valid", len(page) - len(valid))
            names += valid
            if len(page) < want:
                break
            low = b"(" + page[-1]
        return names

    def _range(self, what: str, low: bytes, high: str, count: int) -> list[bytes]:
        """Up to ``count`` members of the name index in (low, high); none where another
        type sits under its name."""
        notes = self.layout.notes

        def call(client: redis.Redis) -> list[bytes]:
            try:
                return cast(list[bytes], client.zrangebylex(notes, low, high, start=0,
                                                            num=count))
            except ResponseError as exc:
                if not is_wrongtype(exc):
                    raise
                self.skips.add("index keys of another type", where=notes)
                return []
        return self.routes.at(notes, what, call)

    def delete(self, name: str) -> None:
        key = self.layout.note(check_note_name(name))
        notes = self.layout.notes
        self.routes.exec_typed(key, f"deleting note {name}", [
            (b"DEL", key), (b"ZREM", notes, name)], {notes: "zset"})


    def reconcile(self) -> int:
        """Drop names from the index whose note is gone (evicted); returns how many."""
        dropped = 0
        for page in self.routes.zscan(self.layout.notes, "reconciling notes"):
            notes = {m: self.layout.note(n) for m, n in
                     ((m, note_member(m)) for m, _ in page) if n is not None}
            dropped += self.routes.drop_vanished(self.layout.notes, None, notes)
        return dropped
