"""The journal of a shared tier: what each server put, deleted and used, in notes all can read.

Each server batches its records for ``journal_interval_s`` and writes them as one note::

    journal/<wall clock ms, 13 digits>-<server id>-<sequence>    msgpack [[op, ns, key, size], ...]

    op "+"  the server wrote chunk (ns, key) of ``size`` bytes; a chunk it keeps at another
            than the default priority has two more fields: [..., priority, retain_s], the
            priority (0-100) and for how many seconds after the note it holds (nil: until
            changed); notes of older servers, without them, read as before
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
signed with it (:mod:`kvtier.auth`). A note holds at most ``MAX_RECORDS`` records. A record's
retention is checked here (an integer priority in 0-100, a finite positive duration, else the
record is dropped) and capped by the reader's tier (:mod:`kvtier.store.peer_retention`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtier.keys import ChunkKey
from kvtier.policies.retention import MAX_PRIORITY, MIN_PRIORITY

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
    priority: int | None = None
    """A ``+`` of a retained chunk: its priority (``None``: the default)."""
    retain_s: float | None = None
    """... held that many seconds from now (``None``: until changed)."""


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
    return msgspec.msgpack.encode([
        [r.op, r.namespace, r.key, r.size] if r.priority is None
        else [r.op, r.namespace, r.key, r.size, r.priority, r.retain_s] for r in records])


Line = tuple[str, bytes, ChunkKey, int, int | None, float | None]
"""One record of a note as a reader applies it: (op, namespace, key, size, priority,
retain_s), the last two ``None`` for a record without retention. A plain tuple of plain
values, which the garbage collector stops tracking at its first pass: a flood of records
leaves no long-lived objects behind to make full collections come sooner."""


class _Retained(msgspec.Struct, array_like=True):
    """A record as written, with or without retention (fields past these are ignored)."""

    op: str
    namespace: bytes
    key: bytes
    size: int
    priority: int | None = None
    retain_s: float | None = None


@dataclass(frozen=True, slots=True)
class Decoded:
    records: list[Line]
    dropped: int
    """Entries left out: malformed, or a put whose size is not ``plausible``."""


_WHOLE = msgspec.msgpack.Decoder(list[tuple[str, bytes, bytes, int]])
_MIXED = msgspec.msgpack.Decoder(list[_Retained])
_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ONE = msgspec.msgpack.Decoder(_Retained)


def decode(data: bytes, plausible: Callable[[int], bool] = lambda _size: True) -> Decoded:
    """The records of a note; malformed entries and puts whose size fails ``plausible`` are
    dropped and counted. A note that does not decode, or holds more than MAX_RECORDS
    entries, is dropped whole (a note is advice, never trusted for bytes: every chunk read
    is verified). A note of well-formed entries is decoded in one call; one with a
    malformed entry, entry by entry."""
    try:
        plain: list[Any] = _WHOLE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _retained(data, plausible)
    if len(plain) > MAX_RECORDS:
        return Decoded([], len(plain))
    out: list[Line] = [
        (op, ns, key, size, None, None) for op, ns, key, size in plain
        if op in OPS and len(ns) == 32 and len(key) == 32 and size >= 0
        and (op != "+" or plausible(size))]
    return Decoded(out, len(plain) - len(out))


def _retained(data: bytes, plausible: Callable[[int], bool]) -> Decoded:
    """A note with retained records (one call), else one with a malformed entry."""
    try:
        whole = _MIXED.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            raw = _LIST.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Decoded([], 1)
        if len(raw) > MAX_RECORDS:
            return Decoded([], len(raw))
        return _valid([line for line in map(_one, raw) if line is not None], len(raw),
                      plausible)
    if len(whole) > MAX_RECORDS:
        return Decoded([], len(whole))
    return _valid([_line(r) for r in whole], len(whole), plausible)


def _line(r: _Retained) -> tuple[Any, ...]:
    return r.op, r.namespace, r.key, r.size, r.priority, r.retain_s


def _one(item: msgspec.Raw) -> tuple[Any, ...] | None:
    try:
        return _line(_ONE.decode(item))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _valid(lines: list[Any], entries: int, plausible: Callable[[int], bool]) -> Decoded:
    out: list[Line] = [
        line for line in lines
        if line[0] in OPS and len(line[1]) == 32 and len(line[2]) == 32 and line[3] >= 0
        and (line[0] != "+" or plausible(line[3])) and _retention_ok(line[4], line[5])]
    return Decoded(out, entries - len(out))


def _retention_ok(priority: int | None, retain_s: float | None) -> bool:
    """No retention, or a priority in 0-100 with no duration or a finite positive one (a
    huge one is capped by the reader, never refused)."""
    if priority is None:
        return retain_s is None
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        return False
    return retain_s is None or (math.isfinite(retain_s) and retain_s > 0)
