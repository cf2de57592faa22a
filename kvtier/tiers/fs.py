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
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import Any

from kvtier import codec
from kvtier.config import TierConfig, parse
from kvtier.errors import ConfigError
from kvtier.keys import ChunkKey
from kvtier.tiers import files
from kvtier.tiers.base import Space, StoredChunk
from kvtier.tiers.files import FileIO, FileOptions, choose_o_direct, listdir, os_errors, temp_name
from kvtier.tiers.shared import (
    CHUNK_FILE,
    NAMESPACE_HEX,
    SharedTier,
    check_note_name,
    chunk_name,
    split_options,
)

FsOptions = FileOptions


class FsTier(SharedTier):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        own, self.sharing = split_options(config.options, where)
        self.options = parse(FsOptions, own, where)
        self.root = os.path.abspath(self.options.path)
        self._tmp = os.path.join(self.root, "tmp")
        self._token = secrets.token_hex(4)
        try:
            for folder in ("chunks", "notes", "tmp"):
                os.makedirs(os.path.join(self.root, folder), mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{where}.path: cannot use {self.root!r}: {exc}") from exc
        direct = choose_o_direct(self.options, self._tmp, where)
        self.io = FileIO(direct, self.options.fsync, self.options.dir_fsync)

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    # ------------------------------------------------------------------ chunks

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        header = codec.ChunkHeader.unpack(view[: codec.USED_HEADER_BYTES])
        name = chunk_name(header.namespace_fp, key)
        tmp = os.path.join(self._tmp, temp_name(key.hex(), self._token))
        with os_errors(self.name, f"writing {key.hex()[:16]}"):
            return self.io.write_atomic(self._path(name), tmp, view)

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        with os_errors(self.name, f"reading {key.hex()[:16]}"):
            return self.io.read_into(self._path(chunk_name(namespace, key)),
                                     memoryview(dst).cast("B"))

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        with (os_errors(self.name, f"deleting {key.hex()[:16]}"),
              contextlib.suppress(FileNotFoundError)):
            os.unlink(self._path(chunk_name(namespace, key)))

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        self.delete(key, namespace=namespace)  # nothing is kept on a volume others read

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        with (os_errors(self.name, f"touching {key.hex()[:16]}"),
              contextlib.suppress(FileNotFoundError)):
            os.utime(self._path(chunk_name(namespace, key)))

    def scan(self) -> Iterator[StoredChunk]:
        for namespace in self.namespaces():
            yield from self.scan_namespace(namespace)

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        top = self._path(f"chunks/{namespace.hex()}")
        with os_errors(self.name, "listing chunks"):
            for shard in listdir(top):
                for entry in listdir(shard.path):
                    match = CHUNK_FILE.fullmatch(entry.name)
                    if match is None or not match[1].startswith(shard.name):
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted while we looked
                        continue
                    key = ChunkKey(bytes.fromhex(match[1]))
                    yield StoredChunk(key, info.st_size, info.st_mtime, 35, namespace)

    def namespaces(self) -> list[bytes]:
        with os_errors(self.name, "listing namespaces"):
            return [bytes.fromhex(e.name) for e in listdir(self._path("chunks"))
                    if NAMESPACE_HEX.fullmatch(e.name)]

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        path = self._path(f"notes/{check_note_name(name)}")
        tmp = os.path.join(self._tmp, temp_name("note", self._token))
        plain = FileIO(False, self.options.fsync)
        with os_errors(self.name, f"writing note {name}"):
            plain.write_atomic(path, tmp, memoryview(data))

    def get_note(self, name: str) -> bytes | None:
        with os_errors(self.name, f"reading note {name}"):
            try:
                with open(self._path(f"notes/{check_note_name(name)}"), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

    def list_notes(self, prefix: str, start_after: str = "") -> list[str]:
        folder = check_note_name(prefix.rstrip("/"))
        with os_errors(self.name, f"listing notes {prefix}"):
            names = sorted(f"{folder}/{e.name}" for e in listdir(self._path(f"notes/{folder}"))
                           if not e.name.endswith(".tmp"))
        return [n for n in names if n > start_after]

    def delete_note(self, name: str) -> None:
        with (os_errors(self.name, f"deleting note {name}"),
              contextlib.suppress(FileNotFoundError)):
            os.unlink(self._path(f"notes/{check_note_name(name)}"))

    # ------------------------------------------------------------------ upkeep

    def clean_stale_temps(self, older_than_s: float) -> int:
        import time

        cutoff = time.time() - older_than_s
        removed = 0
        with os_errors(self.name, "cleaning temporary files"):
            for entry in listdir(self._tmp):
                try:
                    if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed

    def space(self) -> Space | None:
        return files.space(self.root)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self.root, "shared": True,
                "o_direct": self.io.o_direct, "fsync": self.options.fsync}
