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

Notes are written by other servers, so they are untrusted input (docs/security.md): a reader
checks a note's size before fetching it (``MAX_NOTE_BYTES``), decodes and validates it
outside the store lock, drops records that do not parse or whose size cannot be a chunk of
its tier's slot geometry (:func:`plausible`), and with a cluster secret applies only notes
signed with it (:mod:`kvtier.auth`). A note holds at most ``MAX_RECORDS`` records.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvtier.keys import ChunkKey

PREFIX = "journal/"
SKEW_S = 30.0
MAX_RECORDS = 4096
"""Records one note holds at most (a writer batches at most this many; a reader drops a
note with more whole)."""
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


@dataclass(frozen=True, slots=True)
class Decoded:
    records: list[Record]
    dropped: int
    """Entries left out: malformed, or a put whose size is not ``plausible``."""


_RawRecord = tuple[str, bytes, bytes, int]


def decode(data: bytes, plausible: Callable[[int], bool] = lambda _size: True) -> Decoded:
    """The records of a note; malformed entries and puts whose size fails ``plausible`` are
    dropped and counted. A note that does not decode, or holds more than MAX_RECORDS
    entries, is dropped whole (a note is advice, never trusted for bytes: every chunk read
    is verified)."""
    try:
        raw = msgspec.msgpack.decode(data, type=list[msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return Decoded([], 1)
    if len(raw) > MAX_RECORDS:
        return Decoded([], len(raw))
    out: list[Record] = []
    for item in raw:
        try:
            op, namespace, key, size = msgspec.msgpack.decode(item, type=_RawRecord)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if (op in OPS and len(namespace) == 32 and len(key) == 32 and size >= 0
                and (op != "+" or plausible(size))):
            out.append(Record(op, namespace, ChunkKey(key), size))
    return Decoded(out, len(raw) - len(out))
