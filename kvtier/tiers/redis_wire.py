"""One MULTI/EXEC, packed here and sent as one packet on a connection of redis-py's pool.

redis-py's pipeline spends more Python time packing and parsing the few small commands around
a chunk's SET than sending the chunk: measured here, a pipelined MULTI of SET + ZADD + HSET +
SADD with an 8 KiB value took 270 us where a bare SET took 125 us, 70 us of it in packing alone;
at 1 MiB that was a quarter of the write. RESP is simple, so a write packs its commands itself,
hands the chunk's memoryview to the socket without a copy, and reads the replies with redis-py's
parser on redis-py's connection (login, TLS, timeouts unchanged). A connection that fails half
way is disconnected, never given back to the pool with replies left unread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError, WatchError

Arg = bytes | str | int | float | memoryview
BIG = 16 << 10
"""Arguments this long go to the socket as they are (no copy into the packet)."""
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def pack_transaction(commands: Sequence[Sequence[Arg]], *, asking: bool = False
                     ) -> list[bytes | memoryview]:
    """MULTI, ``commands``, EXEC in RESP: small parts joined, big memoryviews left alone;
    ``asking``: ASKING first (a cluster node then serves a slot it is importing)."""
    parts: list[bytes | memoryview] = []
    buf = bytearray(_ASKING + _MULTI if asking else _MULTI)
    for command in commands:
        buf += b"*%d\r\n" % len(command)
        for arg in command:
            if isinstance(arg, memoryview) and arg.nbytes >= BIG:
                buf += b"$%d\r\n" % arg.nbytes
                parts += [bytes(buf), arg.cast("B")]
                buf = bytearray(b"\r\n")
            else:
                data = _encode(arg)
                buf += b"$%d\r\n%s\r\n" % (len(data), data)
    buf += _EXEC
    parts.append(bytes(buf))
    return parts


def transaction(pool: Any, commands: Sequence[Sequence[Arg]], *,
                raise_errors: bool = True, asking: bool = False) -> list[Any]:
    """Run ``commands`` in one MULTI/EXEC on a connection of ``pool``; EXEC's replies.

    Raises redis-py's errors: ConnectionError / TimeoutError from the socket, ResponseError
    for a command the server refused (OOM at maxmemory, a wrong type; with ``raise_errors``
    false such a refusal is left in the replies instead; a cluster's MOVED or ASK is always
    raised), WatchError if EXEC was aborted. ``asking``: after an ASK redirect."""
    packet = pack_transaction(commands, asking=asking)
    conn = pool.get_connection()
    try:
        conn.send_packed_command(packet)
        for _ in range(len(commands) + 1 + asking):  # +OK for (ASKING,) MULTI, +QUEUED each
            conn.read_response()
        replies = conn.read_response()
    except BaseException:
        conn.disconnect()  # replies may be left unread: the socket is done for
        raise
    finally:
        pool.release(conn)
    if replies is None:
        raise WatchError("the transaction was aborted")
    for reply in replies:
        if raise_errors and isinstance(reply, ResponseError):
            raise reply
    return list(replies)


def _encode(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, memoryview):
        return arg.tobytes()
    if isinstance(arg, bool):
        raise TypeError("a bool is not a Redis argument")
    return repr(arg).encode()  # int, float: the shortest text that reads back the same
