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
from typing import Any

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


Line = tuple[str, bytes, ChunkKey, int]
"""One record of a note as a reader applies it: (op, namespace, key, size). A plain tuple of
plain values, which the garbage collector stops tracking at its first pass: a flood of
records leaves no long-lived objects behind to make full collections come sooner."""


@dataclass(frozen=True, slots=True)
class Decoded:
    records: list[Line]
    dropped: int
    """Entries left out: malformed, or a put whose size is not ``plausible``."""


_WHOLE = msgspec.msgpack.Decoder(list[tuple[str, bytes, bytes, int]])
_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ONE = msgspec.msgpack.Decoder(tuple[str, bytes, bytes, int])


def decode(data: bytes, plausible: Callable[[int], bool] = lambda _size: True) -> Decoded:
    """The records of a note; malformed entries and puts whose size fails ``plausible`` are
    dropped and counted. A note that does not decode, or holds more than MAX_RECORDS
    entries, is dropped whole (a note is advice, never trusted for bytes: every chunk read
    is verified). A note of well-formed entries is decoded in one call; one with a
    malformed entry, entry by entry."""
    try:
        lines: list[Any] = _WHOLE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            raw = _LIST.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Decoded([], 1)
        if len(raw) > MAX_RECORDS:
            return Decoded([], len(raw))
        lines = [line for line in map(_one, raw) if line is not None]
        return _valid(lines, len(raw), plausible)
    if len(lines) > MAX_RECORDS:
        return Decoded([], len(lines))
    return _valid(lines, len(lines), plausible)


def _one(item: msgspec.Raw) -> tuple[str, bytes, bytes, int] | None:
    try:
        return _ONE.decode(item)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _valid(lines: list[Any], entries: int, plausible: Callable[[int], bool]) -> Decoded:
    out: list[Line] = [
        line for line in lines
        if line[0] in OPS and len(line[1]) == 32 and len(line[2]) == 32 and line[3] >= 0
        and (line[0] != "+" or plausible(line[3]))]
    return Decoded(out, entries - len(out))
