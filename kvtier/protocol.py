"""The control protocol between engine clients and the node server.

Frames on a unix stream socket: a 4-byte little-endian length, then one msgpack message
(msgspec structs, tagged by ``op``). Every request gets exactly one reply, in order. Bulk data
never crosses the socket: it moves through the shared-memory arena, and messages carry slot
numbers.

Each operation is defined once, here: a request struct naming its reply type (``Op[R]``);
the server registers one handler per request type (:mod:`kvtier.server.service`) and the
client sends any request with one generic ``call`` — adding an operation touches two places.

Rules of the conversation:

- the first message on a connection must be :class:`Hello`, within the server's
  ``frame_timeout_s``; a connection that starts otherwise, or whose hello is refused (another
  protocol version), gets an :class:`Error` and is closed;
- a message, once its first byte arrived, must arrive whole within ``frame_timeout_s``;
- values are checked as they are decoded (key lengths, ranges): a message that is well formed
  but invalid gets ``Error("bad_request", ...)`` naming the field, and the connection stays;
- a frame over ``max_message_bytes`` or one that is not msgpack at all gets
  ``Error("protocol", ...)`` and the connection is closed.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from typing import Annotated, Any, ClassVar, Generic, TypeVar, Union

import msgspec
from msgspec import Meta

from kvtier.errors import ProtocolError
from kvtier.keys import ChunkKey
from kvtier.policies.retention import MAX_RETAIN_S

PROTOCOL_VERSION = 2
MAX_KEYS = 1 << 16
"""Keys in one request: 16M tokens at 256 tokens per chunk."""
MAX_WAIT_S = 60.0
_LEN = struct.Struct("<I")

Key = Annotated[ChunkKey, Meta(min_length=32, max_length=32)]
Keys = Annotated[list[Key], Meta(max_length=MAX_KEYS)]
Fingerprint = Annotated[bytes, Meta(min_length=32, max_length=32)]
Priority = Annotated[int, Meta(ge=0, le=100)]
RetainS = Annotated[float, Meta(gt=0.0, le=MAX_RETAIN_S)]
"""A retention's duration: the priority falls back to the default after it."""
Name = Annotated[str, Meta(max_length=200)]
Tenant = Annotated[str, Meta(min_length=1, max_length=64)]
U32 = Annotated[int, Meta(ge=0, lt=2**32)]


class Reply(msgspec.Struct, tag_field="op"):
    """Base of every answer."""


R = TypeVar("R", bound=Reply)


class Op(msgspec.Struct, Generic[R], tag_field="op", forbid_unknown_fields=True):
    """Base of every request; ``REPLY`` is the type the server answers it with."""

    REPLY: ClassVar[type[Reply]]


# ---------------------------------------------------------------------- replies

class HelloReply(Reply, tag="hello_reply"):
    server_version: str
    arena_name: str
    num_slots: int
    slot_bytes: int
    header_size: int
    lease_ttl_s: float
    instance: str = ""
    """Random per server start: a client seeing a new one remaps the arena, even when a
    fixed ``arena.name`` is reused."""

    @property
    def arena_id(self) -> str:
        """Names one arena of one server start (``name@instance``)."""
        return f"{self.arena_name}@{self.instance}"


class LookupReply(Reply, tag="lookup_reply"):
    tiers: list[str]
    arrival_s: list[float] = []
    """Per chunk, when it could be in the arena (seconds from now, estimated from each
    tier's measured read speed; 0.0 in the arena or when unknown)."""


class ReserveReply(Reply, tag="reserve_reply"):
    slots: list[int | None]


class CountReply(Reply, tag="count_reply"):
    count: int


class LeaseReply(Reply, tag="lease_reply"):
    lease_id: int
    slots: list[int]
    tiers: list[str]
    ready: bool


class LeaseStatus(Reply, tag="lease_status"):
    ready: list[bool]
    failed: list[bool]
    done: bool


class StatsReply(Reply, tag="stats_reply"):
    stats: dict[str, object]


class EventsReply(Reply, tag="events_reply"):
    events: list[tuple[int, str, str, bytes]]
    """(seq, "stored" | "removed", tier, key) in order."""
    next: int
    """Ask from here next time."""
    lost: bool
    """Events after the one asked from were dropped (the log is bounded): resynchronise."""


class Error(Reply, tag="error"):
    code: str
    """``bad_request`` (the client's mistake; nothing changed), ``internal`` (a server bug;
    logged), ``protocol`` / ``version`` / ``busy`` (the connection is closed)."""
    message: str


# ---------------------------------------------------------------------- requests

class Hello(Op[HelloReply], tag="hello"):
    REPLY = HelloReply
    client: Name
    pid: int
    version: int = PROTOCOL_VERSION
    session: Annotated[str, Meta(pattern="^[0-9a-f]{0,64}$")] = ""
    """Random per client object: a client that reconnects with the same session keeps the
    leases and reservations it holds (within the server's ``orphan_grace_s``)."""


class Lookup(Op[LookupReply], tag="lookup"):
    REPLY = LookupReply
    keys: Keys
    namespace: Name = ""
    prompt_tokens: U32 = 0
    chunk_tokens: U32 = 0


class Reserve(Op[ReserveReply], tag="reserve"):
    REPLY = ReserveReply
    namespace_fp: Fingerprint
    keys: Keys
    payload_len: Annotated[int, Meta(ge=1)]
    tokens: Annotated[int, Meta(ge=1, lt=2**32)]
    priority: Priority = 35
    first_index: U32 = 0
    retain_s: RetainS | None = None
    tenant: Tenant | None = None
    """Whose quota a retention above the default counts against (:mod:`kvtier.store.quotas`)."""


class Commit(Op[CountReply], tag="commit"):
    REPLY = CountReply
    keys: Keys


class Abort(Op[CountReply], tag="abort"):
    REPLY = CountReply
    keys: Keys


class Lease(Op[LeaseReply], tag="lease"):
    REPLY = LeaseReply
    keys: Keys


class Wait(Op[LeaseStatus], tag="wait"):
    REPLY = LeaseStatus
    lease_id: int
    timeout_s: Annotated[float, Meta(ge=0.0)] = 0.0
    """Capped at MAX_WAIT_S."""


class Release(Op[CountReply], tag="release"):
    REPLY = CountReply
    lease_id: int


class SetPriority(Op[CountReply], tag="set_priority"):
    REPLY = CountReply
    keys: Keys
    priority: Priority
    retain_s: RetainS | None = None
    keep_stronger: bool = False
    """Leave a chunk held stronger (higher priority; equal, a later deadline) as it is:
    what a request's finish sends, so that it never lowers what another set on a shared
    prefix. Only a plain set (a release) lowers."""
    tenant: Tenant | None = None


class Stats(Op[StatsReply], tag="stats"):
    REPLY = StatsReply


class Report(Op[CountReply], tag="report"):
    """Counter increments from an engine client (``name`` or ``name|tier`` -> amount), so the
    node's /metrics shows what engines saw, not only what the server did."""

    REPLY = CountReply
    client: Name
    counters: Annotated[dict[str, float], Meta(max_length=1024)]


class Register(Op[CountReply], tag="register"):
    """An engine describes a namespace it uses, so tools that only see the node server (the
    router, ``kvtier ls``) can compute its keys and name it."""

    REPLY = CountReply
    namespace_fp: Fingerprint
    info: Annotated[dict[str, str | int], Meta(max_length=32)]
    """At least ``model``, ``chunk_tokens``; also ``block_size``, ``served_model_name``..."""


class Events(Op[EventsReply], tag="events"):
    """What the store stored and removed since ``since`` (of one namespace)."""

    REPLY = EventsReply
    since: Annotated[int, Meta(ge=0)] = 0
    namespace_fp: Fingerprint | None = None
    limit: Annotated[int, Meta(ge=1, le=65536)] = 4096


REQUESTS: tuple[type[Op[Any]], ...] = (
    Hello, Lookup, Reserve, Commit, Abort, Lease, Wait, Release, SetPriority, Stats, Report,
    Register, Events)
"""Every operation (the server's handler table must cover exactly these)."""
REPLIES: tuple[type[Reply], ...] = (
    HelloReply, LookupReply, ReserveReply, CountReply, LeaseReply, LeaseStatus, StatsReply,
    EventsReply, Error)

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[Op[Any]] = msgspec.msgpack.Decoder(
    Union[REQUESTS])  # noqa: UP007 - a union of a runtime tuple
_reply_decoder: msgspec.msgpack.Decoder[Reply] = msgspec.msgpack.Decoder(
    Union[REPLIES])  # noqa: UP007


class InvalidMessage(ProtocolError):
    """Well-formed msgpack whose values break the protocol's rules (the stream is fine)."""


def encode(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


def decode_request(body: bytes) -> Op[Any]:
    """Raises InvalidMessage for bad values, ProtocolError for anything that is not a
    message at all."""
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidMessage(_readable(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed request: {exc}") from exc


def _readable(error: str) -> str:
    """msgspec's "Expected `int` <= 100 - at `$.priority`" as "priority: expected int <= 100"."""
    match = re.fullmatch(r"(.*?)(?: - at `\$\.?(.*)`)?", error, flags=re.S)
    assert match is not None
    what, where = match[1].replace("`", ""), match[2] or "message"
    return f"{where}: {what[:1].lower()}{what[1:]}"


def decode_reply(body: bytes) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed reply: {exc}") from exc


def read_frame(sock: socket.socket, max_bytes: int, *,
               frame_timeout_s: float | None = None) -> bytes | None:
    """One frame's body; ``None`` on a clean end of stream before a frame starts.

    Waits for the first byte as long as the socket's own timeout allows; from then on the
    whole rest must arrive within ``frame_timeout_s`` (when given), however it trickles.
    Raises ProtocolError for an oversized frame, ConnectionError for a stream cut mid-frame,
    TimeoutError when it stalls.
    """
    first = _read_exact(sock, 1, allow_eof=True)
    if first is None:
        return None
    previous = sock.gettimeout()
    deadline = None if frame_timeout_s is None else time.monotonic() + frame_timeout_s
    try:
        rest = _read_exact(sock, _LEN.size - 1, allow_eof=False, deadline=deadline)
        assert rest is not None
        (length,) = _LEN.unpack(first + rest)
        if length > max_bytes:
            raise ProtocolError(f"message of {length} bytes exceeds the limit of {max_bytes}")
        body = _read_exact(sock, length, allow_eof=False, deadline=deadline)
        assert body is not None
        return body
    finally:
        if deadline is not None:
            sock.settimeout(previous)


def _read_exact(sock: socket.socket, n: int, *, allow_eof: bool,
                deadline: float | None = None) -> bytes | None:
    """``n`` bytes; with a ``deadline`` (monotonic), all of them by then: each ``recv``
    waits only for what is left of it, so a trickle of bytes cannot stretch it."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the message did not arrive whole in time")
            sock.settimeout(left)
        count = sock.recv_into(view[got:])
        if count == 0:
            if got == 0 and allow_eof:
                return None
            raise ConnectionError("connection closed in the middle of a message")
        got += count
    return bytes(buf)
