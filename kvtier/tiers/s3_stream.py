"""Moving chunk bytes between an arena slot and an HTTP body without copying them in Python.

:class:`ViewStream` hands a PUT the slot itself: botocore hashes it (SigV4 over plain HTTP)
and urllib3 sends it in blocks, each a slice of the memoryview, never a ``bytes`` copy; it is
seekable, so a retried PUT rewinds it. :func:`read_body_into` streams a GET's body straight
into the destination view; :func:`read_bounded` reads a small one (a note) no further than a cap.
"""

from __future__ import annotations

import io
from typing import Any

from kvtier.errors import ChunkTooLarge, NoteTooLarge, TierIOError


class ViewStream(io.RawIOBase):
    """A read-only, seekable file over a memoryview; ``read`` returns slices of it."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = min(max(base + offset, 0), len(self._view))
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else min(self._pos + size,
                                                                    len(self._view))
        chunk = self._view[self._pos : end]
        self._pos = end
        return chunk

    def readinto(self, buffer: Any) -> int:
        chunk = self.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def __len__(self) -> int:
        return len(self._view) - self._pos


def read_body_into(body: Any, size: int, dst: memoryview, what: str) -> int:
    """Read a GET body of ``size`` bytes into the start of ``dst``; the body is closed.

    An object larger than ``dst`` raises ChunkTooLarge before a byte is read (the
    connection is dropped, not drained); a body that ends early raises TierIOError.
    """
    try:
        if size > len(dst):
            raise ChunkTooLarge(f"{what}: the object holds {size} bytes, more than the "
                                f"{len(dst)} it may (not a chunk of this size)")
        view, got = dst[:size], 0
        while got < size:
            n = body.readinto(view[got:])
            if not n:
                raise TierIOError(f"{what}: the body ended after {got} of {size} bytes")
            got += n
        return got
    finally:
        body.close()


def read_bounded(body: Any, size: int, max_bytes: int, what: str) -> bytes:
    """A GET body of ``size`` bytes (its ContentLength) as bytes; the body is closed.

    A body over ``max_bytes`` raises NoteTooLarge before a byte is read (the connection is
    dropped, not drained); no more than ``max_bytes + 1`` bytes are read whatever the
    server sends.
    """
    try:
        if size > max_bytes:
            raise NoteTooLarge(f"{what}: the object holds {size} bytes, more than the "
                               f"{max_bytes} a note may (not read)")
        data = bytes(body.read(max_bytes + 1))
        if len(data) > max_bytes:
            raise NoteTooLarge(f"{what}: the body ran past its {size} bytes and the "
                               f"{max_bytes} a note may")
        return data
    finally:
        body.close()
