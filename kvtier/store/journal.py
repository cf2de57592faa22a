"""The journal of a shared tier: what each server put, deleted and used, in notes all can read.

Each server batches its records for ``journal_interval_s`` and writes them as one note::

    journal/<wall clock ms, 13 digits>-<server id>-<sequence>    msgpack [[op, ns, key, size], ...]

    op "+"  the server wrote chunk (ns, key) of ``size`` bytes
    op "-"  the server deleted it (evicted, swept, found corrupt or missing)
    op "t"  the server used it (a hit): its recency moves up

Names sort by time, so a reader lists only the names after what it has applied. Clocks of
different nodes disagree a little: a reader lists from ``SKEW_S`` before the newest note it
applied and skips the names it has already seen, so a note from a server whose clock lags is
still applied. The newest note counts only up to the reader's own clock, so a server whose clock
runs ahead cannot move every reader's listing into the future. A note is seen once it was
fetched and applied: one that failed to fetch is fetched again by the next poll. Notes older
than ``journal_keep_s`` are deleted by the sweeping server; a reader that fell further behind
than that lists the whole tier again instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from kvtier.keys import ChunkKey

PREFIX = "journal/"
SKEW_S = 30.0
_NAME = re.compile(r"journal/(\d{13})-([0-9a-f]{1,32})-(\d{1,9})")
OPS = ("+", "-", "t")


@dataclass(frozen=True, slots=True)
class Record:
    op: str
    namespace: bytes
    key: ChunkKey
    size: int = 0


def note_name(ms: int, server: str, seq: int) -> str:
    return f"{PREFIX}{ms:013d}-{server}-{seq:06d}"


def parse_name(name: str) -> tuple[int, str] | None:
    """(ms, server) of a journal note's name, ``None`` for anything else."""
    match = _NAME.fullmatch(name)
    return (int(match[1]), match[2]) if match else None


def start_after(ms: int) -> str:
    """The listing position just before any note of ``ms`` or later."""
    return f"{PREFIX}{max(0, ms):013d}"


def encode(records: list[Record]) -> bytes:
    return msgspec.msgpack.encode([[r.op, r.namespace, r.key, r.size] for r in records])


def decode(data: bytes) -> list[Record]:
    """The records of a note; malformed entries are skipped (a note is advice, never
    trusted for bytes: every chunk read is verified)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return []
    out: list[Record] = []
    for item in raw if isinstance(raw, list) else []:
        if (isinstance(item, list) and len(item) == 4 and item[0] in OPS
                and isinstance(item[1], bytes) and len(item[1]) == 32
                and isinstance(item[2], bytes) and len(item[2]) == 32
                and isinstance(item[3], int) and item[3] >= 0):
            out.append(Record(item[0], item[1], ChunkKey(item[2]), item[3]))
    return out
