"""The stored chunk format: one header page, then the payload.

::

    offset 0      ChunkHeader (struct below, zero-padded to HEADER_SIZE = 4096 bytes)
    offset 4096   payload: all layers' K and V of the chunk, contiguous, engine-defined layout
    ...           zero padding up to a multiple of 4096 (lets the disk tier use O_DIRECT)

The same layout is used in an arena slot and in a file or object, so a lower-tier read lands
in a slot with no extra copy. The header carries its own checksum and the payload's (xxh3-64),
the namespace fingerprint and the key: a torn, truncated, foreign or bit-flipped object fails
:func:`verify` and is never served.

With a cluster secret (:mod:`kvtier.auth`) the header page also carries a MAC, and the
``FLAG_MAC`` flag says so::

    offset 0      the checked struct (magic ... key) and its xxh3-64
    offset 128    key id (8 bytes), nonce (12), tag (16): GMAC over the checked struct, the
                  key id and the payload

:func:`verify` given a keyring demands a MAC one of its secrets made (a shared tier: another
writer may have chosen the bytes); without one it checks the checksums only (the arena and the
node's own disk, written by this node alone).
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvtier.errors import CorruptChunkError, UnauthenticatedChunk
from kvtier.keys import FORMAT_VERSION, ChunkKey

if TYPE_CHECKING:
    from kvtier.auth import Keyring

MAGIC = b"KVTC"
HEADER_SIZE = 4096
PAGE = 4096

_STRUCT = struct.Struct("<4sHHIIBxxxQQ32s32s")
_CHECKED = _STRUCT.size
_HEADER_CHECKSUM = struct.Struct("<Q")
USED_HEADER_BYTES = _CHECKED + _HEADER_CHECKSUM.size
FLAG_MAC = 0x1
_MAC_AT = 128
_MAC = struct.Struct("<8s12s16s")


def align_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


def stored_size(payload_len: int) -> int:
    """Bytes a chunk of ``payload_len`` occupies in a slot, file or object (page padded)."""
    return HEADER_SIZE + align_up(payload_len)


@dataclass(frozen=True)
class ChunkHeader:
    namespace_fp: bytes
    key: ChunkKey
    tokens: int
    payload_len: int
    checksum: int
    priority: int = 35
    flags: int = 0
    version: int = FORMAT_VERSION

    def pack_into(self, buf: memoryview | bytearray) -> None:
        """Write the header into the first USED_HEADER_BYTES of ``buf``."""
        _STRUCT.pack_into(
            buf, 0, MAGIC, self.version, self.flags, HEADER_SIZE, self.tokens, self.priority,
            self.payload_len, self.checksum, self.namespace_fp, self.key,
        )
        digest = xxhash.xxh3_64_intdigest(bytes(buf[:_CHECKED]))
        _HEADER_CHECKSUM.pack_into(buf, _CHECKED, digest)

    @classmethod
    def unpack(cls, buf: memoryview | bytes | bytearray) -> ChunkHeader:
        """Parse and check a header; raises CorruptChunkError if anything is off."""
        if len(buf) < USED_HEADER_BYTES:
            raise CorruptChunkError(f"header truncated: {len(buf)} bytes")
        raw = bytes(buf[:_CHECKED])
        (stored,) = _HEADER_CHECKSUM.unpack_from(buf, _CHECKED)
        if xxhash.xxh3_64_intdigest(raw) != stored:
            raise CorruptChunkError("header checksum mismatch")
        (magic, version, flags, header_size, tokens, priority, payload_len, checksum, ns,
         key) = _STRUCT.unpack(raw)
        if magic != MAGIC or header_size != HEADER_SIZE:
            raise CorruptChunkError("not a kvtier chunk (bad magic or header size)")
        if version != FORMAT_VERSION:
            raise CorruptChunkError(f"chunk format version {version}, expected {FORMAT_VERSION}")
        return cls(ns, ChunkKey(key), tokens, payload_len, checksum, priority, flags, version)


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def seal(buf: memoryview, namespace_fp: bytes, key: ChunkKey, tokens: int, payload_len: int,
         priority: int = 35, keyring: Keyring | None = None) -> ChunkHeader:
    """Checksum the payload already in ``buf[HEADER_SIZE:]`` and write the header in front;
    with a keyring, MAC it with the signing secret too."""
    payload = buf[HEADER_SIZE : HEADER_SIZE + payload_len]
    header = ChunkHeader(namespace_fp, key, tokens, payload_len, payload_checksum(payload),
                         priority, FLAG_MAC if keyring is not None else 0)
    header.pack_into(buf)
    if keyring is not None:
        key_id, nonce = keyring.signing_id, keyring.new_nonce()
        tag = keyring.chunk_tag(key_id, nonce, bytes(buf[:_CHECKED]) + key_id, payload)
        assert tag is not None
        _MAC.pack_into(buf, _MAC_AT, key_id, nonce, tag)
    else:
        buf[_MAC_AT:_MAC_AT + _MAC.size] = bytes(_MAC.size)
    return header


def verify(buf: memoryview, key: ChunkKey, namespace_fp: bytes | None = None,
           keyring: Keyring | None = None) -> ChunkHeader:
    """Check that ``buf`` holds an intact chunk stored under ``key``.

    Raises CorruptChunkError on a bad header, a foreign key or namespace, a payload that does
    not fit ``buf``, or a payload checksum mismatch; with a keyring, UnauthenticatedChunk when
    the chunk has no MAC that one of its secrets made (the MAC then stands for the payload
    checksum: it is the stronger check, and one pass over the payload is enough).
    """
    header = ChunkHeader.unpack(buf)
    if header.key != key:
        raise CorruptChunkError("chunk holds a different key")
    if namespace_fp is not None and header.namespace_fp != namespace_fp:
        raise CorruptChunkError("chunk belongs to a different namespace")
    end = HEADER_SIZE + header.payload_len
    if end > len(buf):
        raise CorruptChunkError(f"payload truncated: need {end} bytes, have {len(buf)}")
    if keyring is not None:
        _authenticate(buf, header, keyring, end)
    elif payload_checksum(buf[HEADER_SIZE:end]) != header.checksum:
        raise CorruptChunkError("payload checksum mismatch")
    return header


def _authenticate(buf: memoryview, header: ChunkHeader, keyring: Keyring, end: int) -> None:
    if not header.flags & FLAG_MAC:
        raise UnauthenticatedChunk("chunk carries no MAC (written without the cluster secret)")
    key_id, nonce, tag = _MAC.unpack_from(buf, _MAC_AT)
    want = keyring.chunk_tag(key_id, nonce, bytes(buf[:_CHECKED]) + key_id,
                             buf[HEADER_SIZE:end])
    if want is None:
        raise UnauthenticatedChunk(f"chunk signed with key id {key_id.hex()}, which is not "
                                   f"among the accepted secrets")
    if not hmac.compare_digest(want, tag):
        raise UnauthenticatedChunk("chunk MAC mismatch (resealed without the cluster secret)")
