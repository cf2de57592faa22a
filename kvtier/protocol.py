"""The control protocol between engine clients and the node server.

Frames on a unix stream socket: a 4-byte little-endian length, then one msgpack message
(msgspec structs, tagged by ``op``). Every request gets exactly one reply, in order. Bulk data
never crosses the socket: it moves through the shared-memory arena, and messages carry slot
numbers. A frame over the server's ``max_message_bytes`` or one that does not decode is
answered with :class:`Error` and the connection is closed.
"""

from __future__ import annotations

import socket
import struct

import msgspec

from kvtier.errors import ProtocolError

PROTOCOL_VERSION = 1
_LEN = struct.Struct("<I")


class Hello(msgspec.Struct, tag="hello"):
    client: str
    pid: int
    version: int = PROTOCOL_VERSION


class Lookup(msgspec.Struct, tag="lookup"):
    keys: list[bytes]
    namespace: str = ""
    prompt_tokens: int = 0
    chunk_tokens: int = 0


class Reserve(msgspec.Struct, tag="reserve"):
    namespace_fp: bytes
    keys: list[bytes]
    payload_len: int
    tokens: int
    priority: int = 35
    first_index: int = 0


class Commit(msgspec.Struct, tag="commit"):
    keys: list[bytes]


class Abort(msgspec.Struct, tag="abort"):
    keys: list[bytes]


class Lease(msgspec.Struct, tag="lease"):
    keys: list[bytes]


class Wait(msgspec.Struct, tag="wait"):
    lease_id: int
    timeout_s: float = 0.0


class Release(msgspec.Struct, tag="release"):
    lease_id: int


class SetPriority(msgspec.Struct, tag="set_priority"):
    keys: list[bytes]
    priority: int


class Stats(msgspec.Struct, tag="stats"):
    pass


class Report(msgspec.Struct, tag="report"):
    """Counter increments from an engine client (``name`` or ``name|tier`` -> amount), so the
    node's /metrics shows what engines saw, not only what the server did."""

    client: str
    counters: dict[str, float]


Request = (Hello | Lookup | Reserve | Commit | Abort | Lease | Wait | Release | SetPriority
           | Stats | Report)


class HelloReply(msgspec.Struct, tag="hello_reply"):
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


class LookupReply(msgspec.Struct, tag="lookup_reply"):
    tiers: list[str]


class ReserveReply(msgspec.Struct, tag="reserve_reply"):
    slots: list[int | None]


class CountReply(msgspec.Struct, tag="count_reply"):
    count: int


class LeaseReply(msgspec.Struct, tag="lease_reply"):
    lease_id: int
    slots: list[int]
    tiers: list[str]
    ready: bool


class LeaseStatus(msgspec.Struct, tag="lease_status"):
    ready: list[bool]
    failed: list[bool]
    done: bool


class StatsReply(msgspec.Struct, tag="stats_reply"):
    stats: dict[str, object]


class Error(msgspec.Struct, tag="error"):
    code: str
    message: str


Reply = (HelloReply | LookupReply | ReserveReply | CountReply | LeaseReply | LeaseStatus
         | StatsReply | Error)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: msgspec.Struct) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


def decode_request(body: bytes) -> Request:
    try:
        return _request_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed request: {exc}") from exc


def decode_reply(body: bytes) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed reply: {exc}") from exc


def read_frame(sock: socket.socket, max_bytes: int) -> bytes | None:
    """One frame's body; ``None`` on a clean end of stream before a frame starts.

    Raises ProtocolError for an oversized frame, ConnectionError for a stream cut mid-frame.
    """
    head = _read_exact(sock, _LEN.size, allow_eof=True)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > max_bytes:
        raise ProtocolError(f"message of {length} bytes exceeds the limit of {max_bytes}")
    body = _read_exact(sock, length, allow_eof=False)
    assert body is not None
    return body


def _read_exact(sock: socket.socket, n: int, *, allow_eof: bool) -> bytes | None:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        count = sock.recv_into(view[got:])
        if count == 0:
            if got == 0 and allow_eof:
                return None
            raise ConnectionError("connection closed in the middle of a message")
        got += count
    return bytes(buf)
