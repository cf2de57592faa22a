"""The ``fs`` tier: a folder on a POSIX mount that several nodes see (NFS, pNFS, a FUSE volume).

Layout under ``options.path`` (see :mod:`kvtier.tiers.shared`)::

    chunks/<ns>/<kk>/<key>.kvc              one chunk, renamed into place whole
    notes/journal/..., notes/servers/...    the servers' journal and heartbeats
    tmp/<name>.<host>.<pid>.<nonce>.tmp     writes in flight, unique per writer

Every write goes to a temporary name of its own (host, pid and random in the name), is
flushed and renamed: two servers writing one key at once each rename a whole file, and a reader
sees either no file or a whole one. A writer killed mid-write leaves its temporary file; the
sweeping server removes those older than ``stale_temp_s``. Recency is the file's mtime, which a
hit refreshes (``touch``). Every call may block on a hung mount; the store bounds it.

Any writer of the folder may leave anything in it: no link below the root is followed, only
regular files are opened (without blocking), and a listing skips and counts (``skipped_entries``)
whatever is not what belongs where it lies (:mod:`kvtier.tiers.files`).
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from kvtier import codec
from kvtier.config import TierConfig, parse
from kvtier.errors import ConfigError, NoteTooLarge
from kvtier.keys import ChunkKey
from kvtier.tiers import files
from kvtier.tiers.base import Space, StoredChunk
from kvtier.tiers.files import FileIO, FileOptions, choose_o_direct, os_errors, temp_name
from kvtier.tiers.shared import (
    CHUNK_FILE,
    MAX_LISTED_NOTES,
    MAX_NOTE_BYTES,
    NAMESPACE_HEX,
    SharedTier,
    check_note_name,
    chunk_name,
    namespace_hex,
    split_options,
)
from kvtier.tiers.skips import Skipped

FsOptions = FileOptions
log = logging.getLogger(__name__)
_SHARD = re.compile(r"[0-9a-f]{2}")


class FsTier(SharedTier):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        own, self.sharing = split_options(config.options, where)
        self.options = parse(FsOptions, own, where)
        self.root = os.path.abspath(self.options.path)
        self._token = secrets.token_hex(4)
        self._skipped = Skipped(name)
        try:
            os.close(files.make_folder(self.root, []))
        except OSError as exc:
            raise ConfigError(f"{where}.path: cannot use {self.root!r}: {exc}") from exc
        self._make_folders()
        direct = choose_o_direct(self.options, self.root, where, shared=True)
        self.io = FileIO(direct, self.options.fsync, self.options.dir_fsync)

    def _make_folders(self) -> None:
        """The tier's folders, made (or put back) at start. Whatever another writer left
        in their place costs this tier its writes until they can be made (each write tries
        again), never this server's start."""
        for folder in ("chunks", "notes", "tmp"):
            try:
                os.close(files.make_folder(self.root, [folder]))
            except OSError as exc:
                log.warning("fs tier %s: cannot make the folder %s/ (%s); writes fail until "
                            "it can be made", self.name, folder, exc)

    @property
    def skipped_entries(self) -> int:
        """Entries listings passed over since start (wrong type, unparseable name)."""
        return self._skipped.total

    def backend_scope(self) -> str:
        return f"fs:{self.root}"

    # ------------------------------------------------------------------ chunks

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        header = codec.ChunkHeader.unpack(view[: codec.USED_HEADER_BYTES])
        parts = chunk_name(header.namespace_fp, key).split("/")
        tmp = ["tmp", temp_name(key.hex(), self._token)]
        with os_errors(self.name, f"writing {key.hex()[:16]}"):
            return self.io.write_atomic(self.root, parts, tmp, view)

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        parts = chunk_name(namespace, key).split("/")
        with os_errors(self.name, f"reading {key.hex()[:16]}"):
            return self.io.read_into(self.root, parts, memoryview(dst).cast("B"))

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        parts = chunk_name(namespace, key).split("/")
        with os_errors(self.name, f"deleting {key.hex()[:16]}"):
            files.unlink(self.root, parts)

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        self.delete(key, namespace=namespace)  # nothing is kept on a volume others read

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        parts = chunk_name(namespace, key).split("/")
        with os_errors(self.name, f"touching {key.hex()[:16]}"):
            files.touch(self.root, parts)

    def scan(self) -> Iterator[StoredChunk]:
        for namespace in self.namespaces():
            yield from self.scan_namespace(namespace)

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        top = ["chunks", namespace_hex(namespace)]
        with os_errors(self.name, "listing chunks"):
            shards = list(files.entries(self.root, top))
        bad = [e.name for e in shards if e.kind != "folder" or not _SHARD.fullmatch(e.name)]
        for shard in shards:
            if shard.kind == "folder" and _SHARD.fullmatch(shard.name):
                with os_errors(self.name, "listing chunks"):
                    found = self._scan_shard([*top, shard.name], namespace, bad)
                yield from found
        self._skipped.report("/".join(top), len(bad), bad[0] if bad else "")

    def _scan_shard(self, parts: list[str], namespace: bytes, bad: list[str]
                    ) -> list[StoredChunk]:
        """The chunk files of one shard folder; what else lies there goes to ``bad``."""
        found = []
        for entry in files.entries(self.root, parts, with_stat=True):
            match = CHUNK_FILE.fullmatch(entry.name)
            if (entry.kind != "file" or entry.info is None or match is None
                    or not match[1].startswith(parts[-1])):
                bad.append(f"{parts[-1]}/{entry.name}")
                continue
            found.append(StoredChunk(ChunkKey(bytes.fromhex(match[1])), entry.info.st_size,
                                     entry.info.st_mtime, 35, namespace))
        return found

    def namespaces(self) -> list[bytes]:
        with os_errors(self.name, "listing namespaces"):
            found = list(files.entries(self.root, ["chunks"]))
        good = [e.name for e in found if e.kind == "folder" and NAMESPACE_HEX.fullmatch(e.name)]
        bad = [e.name for e in found if e.kind != "folder" or not NAMESPACE_HEX.fullmatch(e.name)]
        self._skipped.report("chunks", len(bad), bad[0] if bad else "")
        return [bytes.fromhex(name) for name in good]

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        parts = ["notes", *check_note_name(name).split("/")]
        tmp = ["tmp", temp_name("note", self._token)]
        plain = FileIO(False, self.options.fsync)
        with os_errors(self.name, f"writing note {name}"):
            plain.write_atomic(self.root, parts, tmp, memoryview(data))

    def get_note(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        parts = ["notes", *check_note_name(name).split("/")]
        with os_errors(self.name, f"reading note {name}"):
            opened = files.open_file(self.root, parts)
            if opened is None:
                return None
            fd, info = opened
            try:
                if info.st_size > max_bytes:
                    raise NoteTooLarge(f"{self.name} tier: note {name} has {info.st_size} "
                                       f"bytes, more than the {max_bytes} a note may have")
                files.set_read_mode(fd, False)
                buf = bytearray(info.st_size)
                return bytes(buf[: files.read_fully(fd, memoryview(buf))])
            finally:
                os.close(fd)

    def list_notes(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        folder = check_note_name(prefix.rstrip("/"))
        bad: list[str] = []

        def names() -> Iterator[str]:
            for entry in files.entries(self.root, ["notes", *folder.split("/")]):
                name = f"{folder}/{entry.name}"
                if entry.name.endswith(".tmp"):
                    continue  # older versions wrote notes' temporary files here
                if entry.kind != "file" or not _valid_note(name):
                    bad.append(entry.name)
                elif name > start_after:
                    yield name

        with os_errors(self.name, f"listing notes {prefix}"):
            listed = heapq.nsmallest(max(limit, 0), names())  # memory bounded by limit
        self._skipped.report(f"notes/{folder}", len(bad), bad[0] if bad else "")
        return listed

    def delete_note(self, name: str) -> None:
        parts = ["notes", *check_note_name(name).split("/")]
        with os_errors(self.name, f"deleting note {name}"):
            files.unlink(self.root, parts)

    # ------------------------------------------------------------------ upkeep

    def clean_stale_temps(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        removed = 0
        bad: list[str] = []
        with os_errors(self.name, "cleaning temporary files"):
            folder = files.open_folder(self.root, ["tmp"])
            if folder is None:
                return 0
            try:
                for entry in files.entries_at(folder, with_stat=True):
                    if entry.kind != "file" or entry.info is None:
                        bad.append(entry.name)  # a folder is never removed recursively
                    elif entry.info.st_mtime < cutoff and files.unlink_at(folder, entry.name):
                        removed += 1
            finally:
                os.close(folder)
        self._skipped.report("tmp", len(bad), bad[0] if bad else "")
        return removed

    def space(self) -> Space | None:
        return files.space(self.root)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.root, "shared": True,
                "o_direct": self.io.o_direct, "fsync": self.options.fsync}


def _valid_note(name: str) -> bool:
    try:
        check_note_name(name)
    except ValueError:
        return False
    return True
