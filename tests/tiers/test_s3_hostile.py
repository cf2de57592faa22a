"""The s3 tier against other writers of its bucket (issue 15, items 3 and 10), on a real
SeaweedFS: stray objects and folders in its key space when servers start, objects far larger
than any chunk or note, note names that are not note names, and, with ``prefix: ""``, other
applications' multipart uploads beside its own. Nothing large is ever read into memory, no
listing fails for one bad entry, and cleanup never touches what is not the tier's own."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service_fixtures import ALLOW_MISSING, Bucket

if os.environ.get(ALLOW_MISSING) == "1":  # a developer machine without the shared extra
    pytest.importorskip("boto3")

from store_helpers import (
    NS,
    MakeServer,
    MakeStore,
    expected,
    keys,
    load,
    peak_bytes,
    settle,
    store_chunks,
    store_of,
    wait_until,
)

from kvtier.errors import ChunkTooLarge, NoteTooLarge
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.shared import chunk_name

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .s3_helpers import key_file, s3_tier

pytestmark = pytest.mark.services

MiB = 1 << 20


@pytest.fixture
def keys_file(s3_bucket: Bucket, tmp_path: Path) -> Path:
    return key_file(tmp_path / "keys", s3_bucket.credentials)


@pytest.fixture
def tier(s3_bucket: Bucket, keys_file: Path) -> Iterator[S3Tier]:
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys_file)
    yield tier
    tier.close()


def put(bucket: Bucket, key: str, body: bytes = b"x") -> None:
    bucket.client().put_object(Bucket=bucket.name, Key=key, Body=body)


def test_strays_in_the_key_space_at_start_neither_stop_a_server_nor_hide_a_chunk(
        s3_bucket: Bucket, keys_file: Path, make_store: MakeStore, make_server: MakeServer,
        tmp_path: Path) -> None:
    tier = {"type": "s3", "name": "shared", "capacity_bytes": 1 << 26, "io_threads": 2,
            "options": {"bucket": s3_bucket.name, "endpoint_url": s3_bucket.endpoint,
                        "tls": False, "credentials": f"file:{keys_file}"}}
    writer = make_store(tmp_path / "writer", tiers=[tier])
    writer.rebuild()
    k = keys(3, "strays at start")
    store_chunks(writer, k)
    settle(writer)
    ns = NS.hex()
    for stray in (f"kvtier/chunks/{ns}/zz/readme.txt", f"kvtier/chunks/{ns}/loose.kvc",
                  f"kvtier/chunks/{ns}/00/{k[0].hex()}.kvc",  # the wrong shard
                  f"kvtier/chunks/{ns.upper()}/{k[0].hex()[:2]}/{k[0].hex()}.kvc",
                  "kvtier/chunks/not-a-namespace/x", "kvtier/chunks/\u00e9t\u00e9/y",
                  "kvtier/chunks/loose", f"kvtier/chunks/{ns}/{k[1].hex()[:2]}/"):
        put(s3_bucket, stray)

    reader = make_server(tiers=[tier])
    store = store_of(reader)
    assert wait_until(lambda: store.lookup(k) == ["shared"] * 3), store.lookup(k)
    assert load(store, k).payloads == expected(k)
    store.check_integrity()


def test_listings_skip_and_count_what_does_not_parse(s3_bucket: Bucket, tier: S3Tier) -> None:
    key = key_of("listed")
    tier.write(key, sealed_chunk(key))
    for stray in (f"kvtier/chunks/{NAMESPACE.hex()}/zz/readme.txt",
                  "kvtier/chunks/not-a-namespace/x", "kvtier/chunks/loose"):
        put(s3_bucket, stray)
    for _ in range(2):
        assert [c.key for c in tier.scan()] == [key]
    assert [c.key for c in tier.scan_namespace(NAMESPACE)] == [key]
    assert tier.namespaces() == [NAMESPACE]
    assert tier.skips.counts["objects under chunks/ that are not chunks"] == 2 * 3 + 1
    assert tier.skips.counts["folders under chunks/ that are not namespaces"] == 1
    assert tier.skipped_entries == 2 * 3 + 1 + 1


def test_a_huge_object_under_a_chunk_name_is_refused_unread(s3_bucket: Bucket,
                                                             tier: S3Tier) -> None:
    key, good = key_of("huge"), key_of("fine")
    size = 64 * MiB
    put(s3_bucket, f"kvtier/{chunk_name(NAMESPACE, key)}", bytes(size))
    dst = page_buffer(MiB)
    raised, peak = peak_bytes(lambda: tier.read_into(key, dst, namespace=NAMESPACE))
    assert isinstance(raised, ChunkTooLarge) and f"{size} bytes" in str(raised), raised
    assert peak < 4 * MiB, f"{peak} bytes held: the object was read"
    data = sealed_chunk(good)
    tier.write(good, data)
    assert read_back(tier, good, len(data)) == data


def test_an_oversized_note_raises_note_too_large_unread(s3_bucket: Bucket, tier: S3Tier
                                                        ) -> None:
    size = 8 * MiB
    put(s3_bucket, "kvtier/notes/journal/huge", bytes(size))
    raised, peak = peak_bytes(lambda: tier.get_note("journal/huge"))
    assert isinstance(raised, NoteTooLarge) and f"{size} bytes" in str(raised), raised
    assert peak < 2 * MiB, f"{peak} bytes held: the note was read"
    tier.put_note("journal/small", b"x" * 100)
    with pytest.raises(NoteTooLarge):
        tier.get_note("journal/small", max_bytes=99)
    assert tier.get_note("journal/small", max_bytes=100) == b"x" * 100
    tier.put_note("journal/empty", b"")
    assert tier.get_note("journal/empty") == b""
    assert tier.get_note("journal/missing") is None


def test_list_notes_honours_its_limit_and_leaves_out_invalid_names(s3_bucket: Bucket,
                                                                   tier: S3Tier) -> None:
    valid = [f"journal/{i:03d}" for i in range(25)]
    for name in valid:
        tier.put_note(name, b"n")
    for i in range(12):  # sort before every valid name
        put(s3_bucket, f"kvtier/notes/journal/!{i}")
    for name in ("journal/a b", "journal/\u00e9", "journal/~x", "journal/a..b"):
        put(s3_bucket, f"kvtier/notes/{name}")
    assert tier.list_notes("journal/", limit=10) == valid[:10]
    assert tier.list_notes("journal/", start_after=valid[9], limit=10) == valid[10:20]
    assert tier.list_notes("journal/", start_after=valid[19], limit=10) == valid[20:]
    assert tier.list_notes("journal/") == valid
    assert tier.list_notes("journal/", limit=0) == []


def test_with_an_empty_prefix_cleanup_aborts_only_its_own_stale_uploads(
        s3_bucket: Bucket, keys_file: Path) -> None:
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys_file, prefix="")
    s3 = s3_bucket.client()
    own = chunk_name(NAMESPACE, key_of("killed mid-upload"))
    foreign = ["backups/db.tar", "chunks/readme.txt", "notes/journal/1",
               f"chunks/{NAMESPACE.hex()}/00/{key_of('x').hex()}.kvc",  # the wrong shard
               f"other/{own}"]
    uploads = {key: s3.create_multipart_upload(Bucket=s3_bucket.name, Key=key)["UploadId"]
               for key in [own, *foreign]}
    try:
        time.sleep(1.2)  # the server keeps whole seconds
        assert tier.clean_stale_temps(0.5) == 1
        left = s3.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", [])
        assert sorted(u["Key"] for u in left) == sorted(foreign)
    finally:
        for key, upload in uploads.items():
            try:
                s3.abort_multipart_upload(Bucket=s3_bucket.name, Key=key, UploadId=upload)
            except Exception as exc:  # the tier's own one is gone already
                assert "NoSuchUpload" in str(exc) and key == own, exc
        tier.close()
