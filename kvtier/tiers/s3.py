"""The ``s3`` tier: one bucket of an S3-compatible store (AWS, MinIO, StorageGRID, SeaweedFS).

One object per chunk, under the layout of :mod:`kvtier.tiers.shared` behind ``prefix``::

    <prefix>chunks/<ns>/<kk>/<key>.kvc      one sealed chunk, one PUT (a multipart upload
                                            only above multipart_threshold)
    <prefix>notes/<name>                    the servers' journal and heartbeats

A PUT is atomic: a reader sees the old object or the whole new one, never a part, and an
upload that never completes is never visible (``clean_stale_temps`` aborts those of killed
writers). Recency is ``LastModified``, which a hit refreshes by copying the object onto
itself with new metadata (``touch``). Options, credentials, timeouts: docs/shared.md#s3.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtier import codec
from kvtier.config import TierConfig
from kvtier.errors import TierIOError, TierTimeout
from kvtier.keys import ChunkKey
from kvtier.tiers.base import StoredChunk
from kvtier.tiers.s3_client import make_client
from kvtier.tiers.s3_errors import error_code, is_missing, s3_errors
from kvtier.tiers.s3_options import parse_s3_options
from kvtier.tiers.s3_stream import ViewStream, read_body_into, read_bounded
from kvtier.tiers.shared import (
    CHUNK_FILE,
    MAX_LISTED_NOTES,
    MAX_NOTE_BYTES,
    NAMESPACE_HEX,
    NOTE_NAME,
    SharedTier,
    check_note_name,
    chunk_name,
)
from kvtier.tiers.skips import Skips

log = logging.getLogger("kvtier.tiers")
STRAY_OBJECT = "objects under chunks/ that are not chunks"


class S3Tier(SharedTier):
    def __init__(self, name: str, config: TierConfig) -> None:
        super().__init__(name, config)
        where = f"{name}.options"
        self.options, self.sharing = parse_s3_options(config.options, where)
        self.bucket = self.options.bucket
        self.prefix = self.options.prefix
        self._source = str(self.options.credential_source)
        self._client = make_client(self.options, where)
        self._slots = threading.BoundedSemaphore(self.options.max_connections)
        self.skips = Skips(name)
        """Objects in the tier's key space that are not its own, by kind."""
        if config.io_timeout_s < self.options.worst_case_s:
            log.warning("tier %s: io_timeout_s %.1f s is shorter than a failing S3 call can "
                        "take (%.1f s: retries x timeouts); the store gives up first",
                        name, config.io_timeout_s, self.options.worst_case_s)
        if self.options.create_bucket:
            self._ensure_bucket()

    @property
    def skipped_entries(self) -> int:
        """Entries listings and reads passed over since start (``skips.counts`` by kind)."""
        return self.skips.total()

    def backend_scope(self) -> str:
        return f"s3:{self.bucket}/{self.prefix}"

    # ------------------------------------------------------------------ plumbing

    @contextlib.contextmanager
    def _call(self, doing: str) -> Iterator[None]:
        """One S3 transfer: a pooled connection (waiting for one is bounded too), errors
        translated."""
        if not self._slots.acquire(timeout=self.options.worst_case_s):
            raise TierTimeout(f"{self.name} tier: {doing}: all {self.options.max_connections} "
                              "connections stayed busy")
        try:
            with s3_errors(self.name, doing, bucket=self.bucket, source=self._source):
                yield
        finally:
            self._slots.release()

    def _chunk_key(self, namespace: bytes, key: ChunkKey) -> str:
        return f"{self.prefix}{chunk_name(namespace, key)}"

    def _note_key(self, name: str) -> str:
        return f"{self.prefix}notes/{check_note_name(name)}"

    def _get(self, key: str) -> dict[str, Any] | None:
        """GetObject, or None where there is no such object."""
        try:
            response: dict[str, Any] = self._client.get_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if error_code(exc) and is_missing(exc):
                return None
            raise
        return response

    def _ensure_bucket(self) -> None:
        with self._call(f"creating bucket {self.bucket}"):
            try:
                self._client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:
                if error_code(exc) not in ("404", "NoSuchBucket", "NotFound"):
                    raise
            region = self._client.meta.region_name
            where = ({} if region == "us-east-1" else
                     {"CreateBucketConfiguration": {"LocationConstraint": region}})
            try:
                self._client.create_bucket(Bucket=self.bucket, **where)
            except Exception as exc:
                if error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    # ------------------------------------------------------------------ chunks

    def write(self, key: ChunkKey, data: memoryview) -> int:
        view = memoryview(data).cast("B")
        header = codec.ChunkHeader.unpack(view[: codec.USED_HEADER_BYTES])
        name = self._chunk_key(header.namespace_fp, key)
        if len(view) >= self.options.multipart_threshold:
            self._write_multipart(name, view, key)
            return len(view)
        with self._call(f"writing {key.hex()[:16]}"):
            self._client.put_object(Bucket=self.bucket, Key=name, Body=ViewStream(view),
                                    ContentLength=len(view))
        return len(view)

    def _write_multipart(self, name: str, view: memoryview, key: ChunkKey) -> None:
        doing = f"writing {key.hex()[:16]} in parts"
        with self._call(doing):
            upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=name)
        upload_id = upload["UploadId"]
        try:
            parts = []
            step = self.options.multipart_part_size
            for number, start in enumerate(range(0, len(view), step), start=1):
                part = view[start : start + step]
                with self._call(doing):
                    done = self._client.upload_part(
                        Bucket=self.bucket, Key=name, UploadId=upload_id, PartNumber=number,
                        Body=ViewStream(part), ContentLength=len(part))
                parts.append({"ETag": done["ETag"], "PartNumber": number})
            with self._call(doing):
                self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload_id,
                    MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(TierIOError), self._call(f"aborting {doing}"):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=name,
                                                    UploadId=upload_id)
            raise

    def read_into(self, key: ChunkKey, dst: memoryview, *, namespace: bytes) -> int | None:
        doing = f"reading {key.hex()[:16]}"
        with self._call(doing):
            response = self._get(self._chunk_key(namespace, key))
            if response is None:
                return None
            return read_body_into(response["Body"], int(response["ContentLength"]),
                                  memoryview(dst).cast("B"), f"{self.name} tier: {doing}")

    def delete(self, key: ChunkKey, *, namespace: bytes) -> None:
        with self._call(f"deleting {key.hex()[:16]}"):  # S3 answers 204 for a missing key
            self._client.delete_object(Bucket=self.bucket, Key=self._chunk_key(namespace, key))

    def quarantine(self, key: ChunkKey, *, namespace: bytes) -> None:
        self.delete(key, namespace=namespace)  # nothing is kept in a bucket others read

    def touch(self, key: ChunkKey, *, namespace: bytes) -> None:
        name = self._chunk_key(namespace, key)
        with self._call(f"touching {key.hex()[:16]}"):
            try:  # a copy onto itself must change something: the metadata, with the time
                self._client.copy_object(
                    Bucket=self.bucket, Key=name, CopySource={"Bucket": self.bucket, "Key": name},
                    MetadataDirective="REPLACE", Metadata={"kvtier-touched": f"{time.time():.3f}"})
            except Exception as exc:
                if not (error_code(exc) and is_missing(exc)):
                    raise

    def scan(self) -> Iterator[StoredChunk]:
        before = self.skips.snapshot()
        yield from self._chunks(f"{self.prefix}chunks/")
        self.skips.settle(before, (STRAY_OBJECT,))  # a complete pass: gone if none met

    def scan_namespace(self, namespace: bytes) -> Iterator[StoredChunk]:
        yield from self._chunks(f"{self.prefix}chunks/{namespace.hex()}/")

    def _chunks(self, prefix: str) -> Iterator[StoredChunk]:
        """Chunk objects under ``prefix``; any other object (a stray file, a bad namespace
        folder, a wrong shard) is skipped and counted."""
        top = len(f"{self.prefix}chunks/")
        for page in self._pages("listing chunks", Prefix=prefix):
            for obj in page.get("Contents", ()):
                found = _parse_chunk(obj["Key"][top:])
                if found is None:
                    self.skips.add(STRAY_OBJECT)
                    continue
                namespace, key = found
                yield StoredChunk(key, int(obj["Size"]), obj["LastModified"].timestamp(),
                                  35, namespace)

    def namespaces(self) -> list[bytes]:
        top = f"{self.prefix}chunks/"
        found = []
        for page in self._pages("listing namespaces", Prefix=top, Delimiter="/"):
            for common in page.get("CommonPrefixes", ()):
                name = common["Prefix"][len(top) :].rstrip("/")
                if NAMESPACE_HEX.fullmatch(name):
                    found.append(bytes.fromhex(name))
                else:
                    self.skips.add("folders under chunks/ that are not namespaces")
        return found

    def _pages(self, doing: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """ListObjectsV2 pages; each fetched under its own connection slot and timeout."""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = iter(paginator.paginate(Bucket=self.bucket, **kwargs))
        while True:
            with self._call(doing):
                page = next(pages, None)
            if page is None:
                return
            yield page

    # ------------------------------------------------------------------ notes

    def put_note(self, name: str, data: bytes) -> None:
        key = self._note_key(name)
        with self._call(f"writing note {name}"):
            self._client.put_object(Bucket=self.bucket, Key=key, Body=bytes(data))

    def get_note(self, name: str, max_bytes: int = MAX_NOTE_BYTES) -> bytes | None:
        key = self._note_key(name)
        doing = f"reading note {name}"
        with self._call(doing):
            response = self._get(key)
            if response is None:
                return None
            return read_bounded(response["Body"], int(response["ContentLength"]), max_bytes,
                                f"{self.name} tier: {doing}")

    def list_notes(self, prefix: str, start_after: str = "",
                   limit: int = MAX_LISTED_NOTES) -> list[str]:
        """The first ``limit`` valid note names directly in ``prefix``, in order; objects
        whose names are not note names are skipped and counted."""
        folder = f"{check_note_name(prefix.rstrip('/'))}/"
        top = f"{self.prefix}notes/"
        extra = {"StartAfter": f"{top}{start_after}"} if start_after else {}
        names: list[str] = []
        if limit <= 0:
            return names
        for page in self._pages(f"listing notes {prefix}", Prefix=f"{top}{folder}",
                                Delimiter="/", MaxKeys=min(limit, 1000), **extra):
            listed = [obj["Key"][len(top) :] for obj in page.get("Contents", ())]
            valid = [n for n in listed if _is_note_name(n)]
            self.skips.add("note objects whose names are not note names",
                           len(listed) - len(valid))
            names += (n for n in valid if n > start_after)
            if len(names) >= limit:
                break
        return sorted(names)[:limit]

    def delete_note(self, name: str) -> None:
        key = self._note_key(name)
        with self._call(f"deleting note {name}"):
            self._client.delete_object(Bucket=self.bucket, Key=key)

    # ------------------------------------------------------------------ upkeep

    def clean_stale_temps(self, older_than_s: float) -> int:
        """Abort multipart uploads of chunks (``<prefix>chunks/<ns>/<kk>/<key>.kvc``, the only
        uploads this tier makes) begun more than ``older_than_s`` ago (by the server's clock,
        compared with ours). Any other upload is left alone, whatever the prefix: with
        ``prefix: ""`` the bucket's other applications upload beside it."""
        cutoff = time.time() - older_than_s
        stale = [(u["Key"], u["UploadId"]) for u in self._uploads()
                 if self._own_chunk(u["Key"]) and u["Initiated"].timestamp() < cutoff]
        for key, upload_id in stale:
            with self._call("aborting a stale upload"):
                try:
                    self._client.abort_multipart_upload(Bucket=self.bucket, Key=key,
                                                        UploadId=upload_id)
                except Exception as exc:
                    if error_code(exc) != "NoSuchUpload":
                        raise
        return len(stale)

    def _own_chunk(self, key: str) -> bool:
        top = f"{self.prefix}chunks/"
        return key.startswith(top) and _parse_chunk(key[len(top) :]) is not None

    def _uploads(self) -> Iterator[dict[str, Any]]:
        paginator = self._client.get_paginator("list_multipart_uploads")
        pages = iter(paginator.paginate(Bucket=self.bucket, Prefix=f"{self.prefix}chunks/"))
        while True:
            with self._call("listing unfinished uploads"):
                page = next(pages, None)
            if page is None:
                return
            yield from page.get("Uploads", ())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shared": True,
                "endpoint": self._client.meta.endpoint_url, "bucket": self.bucket,
                "prefix": self.prefix, "region": self._client.meta.region_name,
                "addressing": self.options.addressing, "tls": self.options.tls,
                "ca_bundle": self.options.ca_bundle, "credentials": self._source,
                "max_connections": self.options.max_connections,
                "multipart_threshold": self.options.multipart_threshold,
                "worst_case_call_s": round(self.options.worst_case_s, 2)}

    def close(self) -> None:
        self._client.close()


def _is_note_name(name: str) -> bool:
    return NOTE_NAME.fullmatch(name) is not None and ".." not in name


def _parse_chunk(rest: str) -> tuple[bytes, ChunkKey] | None:
    """``<ns>/<kk>/<key>.kvc`` -> (namespace, key); None for anything else in the folder."""
    parts = rest.split("/")
    if len(parts) != 3 or not NAMESPACE_HEX.fullmatch(parts[0]):
        return None
    match = CHUNK_FILE.fullmatch(parts[2])
    if match is None or not match[1].startswith(parts[1]) or len(parts[1]) != 2:
        return None
    return bytes.fromhex(parts[0]), ChunkKey(bytes.fromhex(match[1]))
