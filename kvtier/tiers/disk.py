"""The node-local disk tier: one file per chunk, written under a temporary name and renamed.

Layout under ``options.path`` (only hex of keys ever becomes a file name)::

    chunks/ab/cd/abcd…(64 hex).kvc    a stored chunk, byte for byte the arena slot (codec layout)
    tmp/<hex>.<host>.<pid>.<random>.tmp   a write in flight; leftovers of dead writers go in scan()
    quarantine/<name>.<time_ns>       chunks that failed verification, bad names, bad headers

Chunks are page padded and arena slots page aligned, so reads and writes bypass the page cache
with O_DIRECT where the filesystem allows it: the arena is the RAM tier, a second copy of the
same bytes in the page cache would only crowd it out.

Nothing under the root is trusted to be what its name says (a crash, an operator, another
program): no link is followed, only regular files are opened (without blocking), and whatever
is not a chunk in its place is moved to quarantine and counted (``skipped_entries``), never
failing a scan (:mod:`kvtier.tiers.files`).
"""

from __future__ import annotations

import contextlib
import logging
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
from kvtier.tiers.files import (
    Entry,
    FileIO,
    FileOptions,
    choose_o_direct,
    os_errors,
    temp_name,
)
from kvtier.tiers.skips import Skipped

log = logging.getLogger(__name__)

_SHARD = re.compile(r"[0-9a-f]{2}")
_CHUNK_NAME = re.compile(r"([0-9a-f]{64})\.kvc")
_LEAF_DEPTH = 2  # chunks/ab/cd/<key>.kvc


DiskOptions = FileOptions


class DiskTier(LowerTier):
    """Chunks as files on a local filesystem; see the module docstring for the layout."""

    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        self.options = parse(DiskOptions, config.options, where)
        self.root = os.path.abspath(self.options.path)
        self._tmp = os.path.join(self.root, "tmp")
        self._token = secrets.token_hex(4)  # tells this instance's temp files from leftovers
        self._skipped = Skipped(name)
        try:
            for folder in ("chunks", "tmp", "quarantine"):
                os.close(files.make_folder(self.root, [folder]))
        except OSError as exc:
            raise ConfigError(f"{where}.path: cannot use {self.root!r}: {exc}") from exc
        self.o_direct = choose_o_direct(self.options, self._tmp, where)
        self.io = FileIO(self.o_direct, self.options.fsync, self.options.dir_fsync)

    @property
    def skipped_entries(self) -> int:
        """Entries scans found out of place (quarantined, or left where they could not be
        moved) since start."""
        return self._skipped.total

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        hexkey = _hex(key)
        tmp = ["tmp", temp_name(hexkey, self._token)]
        with os_errors("disk", f"writing {hexkey}"):  # folders removed under us are made again
            return self.io.write_atomic(self.root, _chunk_parts(hexkey), tmp, view)

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        hexkey = _hex(key)
        with os_errors("disk", f"reading {hexkey}"):
            return self.io.read_into(self.root, _chunk_parts(hexkey), memoryview(dst).cast("B"))

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        hexkey = _hex(key)
        with os_errors("disk", f"deleting {hexkey}"):
            files.unlink(self.root, _chunk_parts(hexkey))

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        parts = _chunk_parts(_hex(key))
        with os_errors("disk", f"quarantining {parts[-1]}"):
            folder = files.open_folder(self.root, parts[:-1])
            if folder is None:
                return
            try:
                with contextlib.suppress(FileNotFoundError):
                    self._move_to_quarantine(folder, parts[-1])
            finally:
                os.close(folder)

    def scan(self) -> Iterator[StoredChunk]:
        with os_errors("disk", "scanning"):
            self._remove_dead_temps()
            chunks = files.open_folder(self.root, ["chunks"])
        if chunks is None:
            return
        out_of_place: list[str] = []
        try:
            with os_errors("disk", "scanning"):
                yield from self._scan_folder(chunks, "", out_of_place)
        finally:
            os.close(chunks)
        self._skipped.report("chunks", len(out_of_place),
                             out_of_place[0] if out_of_place else "")

    def space(self) -> Space | None:
        return files.space(self.root)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.root, "o_direct": self.o_direct,
                "fsync": self.options.fsync, "dir_fsync": self.options.dir_fsync}

    def _scan_folder(self, folder: int, shard: str, out_of_place: list[str]
                     ) -> Iterator[StoredChunk]:
        """The chunks under one folder of chunks/ (``shard``: the hex its path spells);
        whatever is not a chunk in its place is quarantined, one bad entry at a time."""
        for entry in list(files.entries_at(folder)):
            try:
                if len(shard) < 2 * _LEAF_DEPTH:
                    inner = _open_shard(folder, entry)
                    if inner is not None:
                        try:
                            yield from self._scan_folder(inner, shard + entry.name,
                                                         out_of_place)
                        finally:
                            os.close(inner)
                        continue
                    found = None
                else:
                    found = _inspect(folder, entry, shard)
                if found is not None:
                    yield found
                    continue
                out_of_place.append(f"{shard}/{entry.name}")
                self._move_to_quarantine(folder, entry.name)
            except FileNotFoundError:  # deleted while we looked
                continue
            except OSError as exc:  # one entry we cannot inspect or move: left, counted
                log.debug("disk tier %s: cannot inspect %.80r: %s", self.name, entry.name, exc)
                out_of_place.append(f"{shard}/{entry.name}")

    def _move_to_quarantine(self, folder: int, name: str) -> None:
        """Move the entry itself (a link or a folder as they are, never followed)."""
        quarantine = files.make_folder(self.root, ["quarantine"])
        try:
            # leave room for the suffix within NAME_MAX
            os.replace(name, f"{name[:200]}.{time.time_ns()}", src_dir_fd=folder,
                       dst_dir_fd=quarantine)
        finally:
            os.close(quarantine)

    def _remove_dead_temps(self) -> None:
        tmp = files.open_folder(self.root, ["tmp"])
        if tmp is None:
            return
        stuck: list[str] = []
        try:
            for entry in list(files.entries_at(tmp)):
                try:
                    if entry.kind == "folder":
                        self._move_to_quarantine(tmp, entry.name)  # never removed recursively
                    elif not self._in_flight(entry.name):
                        files.unlink_at(tmp, entry.name)  # a link itself, never its target
                except FileNotFoundError:
                    continue
                except OSError:
                    stuck.append(entry.name)
        finally:
            os.close(tmp)
        self._skipped.report("tmp", len(stuck), stuck[0] if stuck else "")

    def _in_flight(self, name: str) -> bool:
        parts = name.split(".")  # <hex>.<host>.<pid>.<nonce>.tmp (files.temp_name)
        if len(parts) != 5 or not parts[2].isdigit():
            return False
        pid = int(parts[2])
        if pid == os.getpid():  # pids repeat across restarts (pid 1 in a container)
            return parts[3].startswith(self._token)
        return alive(pid)


def _open_shard(folder: int, entry: Entry) -> int | None:
    """The shard folder ``entry`` opened, if it is one (a real folder named by 2 hex)."""
    if entry.kind != "folder" or _SHARD.fullmatch(entry.name) is None:
        return None
    return files.open_folder_at(folder, entry.name)


def _inspect(folder: int, entry: Entry, shard: str) -> StoredChunk | None:
    """The chunk's index entry from its header, or ``None`` if the entry is not that chunk
    (a wrong name or place, not a regular file, a header for another key, cut short)."""
    match = _CHUNK_NAME.fullmatch(entry.name)
    if entry.kind != "file" or match is None or not match[1].startswith(shard):
        return None
    key = ChunkKey(bytes.fromhex(match[1]))
    opened = files.open_file_at(folder, entry.name)
    if opened is None:
        return None
    fd, info = opened
    try:
        files.set_read_mode(fd, False)
        head = os.pread(fd, codec.USED_HEADER_BYTES, 0)
    finally:
        os.close(fd)
    try:
        header = codec.ChunkHeader.unpack(head)
    except CorruptChunkError:
        return None
    if header.key != key or info.st_size < codec.stored_size(header.payload_len):
        return None
    return StoredChunk(key, info.st_size, info.st_mtime, header.priority, header.namespace_fp)


def _chunk_parts(hexkey: str) -> list[str]:
    return ["chunks", hexkey[0:2], hexkey[2:4], f"{hexkey}.kvc"]


def _hex(key: ChunkKey) -> str:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a chunk key is {KEY_BYTES} bytes, got {len(key)}")
    return key.hex()
