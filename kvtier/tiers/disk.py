"""The node-local disk tier: one file per chunk, written under a temporary name and renamed.

Layout under ``options.path`` (only hex of keys ever becomes a file name)::

    chunks/ab/cd/abcd…(64 hex).kvc    a stored chunk, byte for byte the arena slot (codec layout)
    tmp/<hex>.<host>.<pid>.<random>.tmp   a write in flight; leftovers of dead writers go in scan()
    quarantine/<name>.<time_ns>       chunks that failed verification, bad names, bad headers

Chunks are page padded and arena slots page aligned, so reads and writes bypass the page cache
with O_DIRECT where the filesystem allows it: the arena is the RAM tier, a second copy of the
same bytes in the page cache would only crowd it out.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from kvtier import codec
from kvtier.config import TierConfig, parse
from kvtier.errors import ConfigError, CorruptChunkError
from kvtier.keys import KEY_BYTES, ChunkKey
from kvtier.processes import alive
from kvtier.tiers import files
from kvtier.tiers.base import LowerTier, Space, StoredChunk
from kvtier.tiers.files import FileIO, FileOptions, choose_o_direct, listdir, os_errors, temp_name

_SHARD = re.compile(r"[0-9a-f]{2}")
_CHUNK_NAME = re.compile(r"([0-9a-f]{64})\.kvc")


DiskOptions = FileOptions


class DiskTier(LowerTier):
    """Chunks as files on a local filesystem; see the module docstring for the layout."""

    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        self.options = parse(DiskOptions, config.options, where)
        self.root = os.path.abspath(self.options.path)
        self._chunks = os.path.join(self.root, "chunks")
        self._tmp = os.path.join(self.root, "tmp")
        self._quarantine = os.path.join(self.root, "quarantine")
        self._token = secrets.token_hex(4)  # tells this instance's temp files from leftovers
        try:
            self._make_folders()
        except OSError as exc:
            raise ConfigError(f"{where}.path: cannot use {self.root!r}: {exc}") from exc
        self.o_direct = choose_o_direct(self.options, self._tmp, where)
        self.io = FileIO(self.o_direct, self.options.fsync, self.options.dir_fsync)

    def _make_folders(self) -> None:
        for directory in (self._chunks, self._tmp, self._quarantine):
            os.makedirs(directory, mode=0o700, exist_ok=True)

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        hexkey = _hex(key)
        tmp = os.path.join(self._tmp, temp_name(hexkey, self._token))
        with os_errors("disk", f"writing {hexkey}"):
            try:
                return self.io.write_atomic(self._chunk_path(hexkey), tmp, view)
            except FileNotFoundError:  # the tier's folder was removed under us: make it again
                self._make_folders()
                return self.io.write_atomic(self._chunk_path(hexkey), tmp, view)

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        hexkey = _hex(key)
        with os_errors("disk", f"reading {hexkey}"):
            return self.io.read_into(self._chunk_path(hexkey), memoryview(dst).cast("B"))

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        hexkey = _hex(key)
        with os_errors("disk", f"deleting {hexkey}"), contextlib.suppress(FileNotFoundError):
            os.unlink(self._chunk_path(hexkey))

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        hexkey = _hex(key)
        with os_errors("disk", f"quarantining {hexkey}"), contextlib.suppress(FileNotFoundError):
            self._move_to_quarantine(self._chunk_path(hexkey))

    def scan(self) -> Iterator[StoredChunk]:
        with os_errors("disk", "scanning"):
            self._remove_dead_temps()
            for path, key in self._walk_chunks():
                try:
                    found = _inspect(path, key) if key is not None else None
                    if found is None:
                        self._move_to_quarantine(path)
                except FileNotFoundError:  # deleted while we looked
                    continue
                if found is not None:
                    yield found

    def space(self) -> Space | None:
        return files.space(self.root)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.root, "o_direct": self.o_direct,
                "fsync": self.options.fsync, "dir_fsync": self.options.dir_fsync}

    def _chunk_path(self, hexkey: str) -> str:
        return os.path.join(self._chunks, hexkey[0:2], hexkey[2:4], f"{hexkey}.kvc")

    def _move_to_quarantine(self, path: str) -> None:
        name = os.path.basename(path)[:200]  # leave room for the suffix within NAME_MAX
        os.replace(path, os.path.join(self._quarantine, f"{name}.{time.time_ns()}"))

    def _remove_dead_temps(self) -> None:
        for entry in listdir(self._tmp):
            if entry.is_dir(follow_symlinks=False):
                self._move_to_quarantine(entry.path)  # not ours to delete recursively
            elif not self._in_flight(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _in_flight(self, name: str) -> bool:
        parts = name.split(".")  # <hex>.<host>.<pid>.<nonce>.tmp (files.temp_name)
        if len(parts) != 5 or not parts[2].isdigit():
            return False
        pid = int(parts[2])
        if pid == os.getpid():  # pids repeat across restarts (pid 1 in a container)
            return parts[3].startswith(self._token)
        return alive(pid)

    def _walk_chunks(self) -> Iterator[tuple[str, ChunkKey | None]]:
        """Every entry under chunks/ with its key, or ``None`` where it is not a chunk file."""
        for top in listdir(self._chunks):
            if not _is_shard(top):
                yield top.path, None
                continue
            for mid in listdir(top.path):
                if not _is_shard(mid):
                    yield mid.path, None
                    continue
                for leaf in listdir(mid.path):
                    yield leaf.path, _key_of(leaf, top.name + mid.name)


def _is_shard(entry: os.DirEntry[str]) -> bool:
    return _SHARD.fullmatch(entry.name) is not None and entry.is_dir(follow_symlinks=False)


def _key_of(entry: os.DirEntry[str], shard: str) -> ChunkKey | None:
    """The key a file under chunks/<shard> is named for, if it is a chunk file in its place."""
    match = _CHUNK_NAME.fullmatch(entry.name)
    if match is None or not match[1].startswith(shard):
        return None
    return ChunkKey(bytes.fromhex(match[1])) if entry.is_file(follow_symlinks=False) else None


def _inspect(path: str, key: ChunkKey) -> StoredChunk | None:
    """The chunk's index entry from its header, or ``None`` if the file is not that chunk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        stat = os.fstat(fd)
        head = os.pread(fd, codec.USED_HEADER_BYTES, 0)
    finally:
        os.close(fd)
    try:
        header = codec.ChunkHeader.unpack(head)
    except CorruptChunkError:
        return None
    if header.key != key or stat.st_size < codec.stored_size(header.payload_len):
        return None
    return StoredChunk(key, stat.st_size, stat.st_mtime, header.priority, header.namespace_fp)


def _hex(key: ChunkKey) -> str:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
    return key.hex()
