"""The s3 tier against a real SeaweedFS on loopback (never a mock): both conformance suites,
then what only an object store has: its layout, multipart uploads and unfinished ones,
addressing, TLS with a custom CA, credentials and secrets, outages, corrupted objects."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from service_fixtures import Bucket

from kvtier import codec
from kvtier.errors import CorruptChunkError
from kvtier.tiers.s3 import S3Tier
from kvtier.tiers.shared import SharedTier, chunk_name

from .conformance import NAMESPACE, key_of, page_buffer, read_back, sealed_chunk
from .s3_helpers import key_file, peer_of, s3_tier
from .shared_conformance import OTHER, SharedTierConformance, sealed_in

MiB = 1 << 20

pytestmark = pytest.mark.services


class TestS3Conformance(SharedTierConformance):
    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket: Bucket) -> None:
        self.bucket = s3_bucket

    def make_tier(self, tmp_path: Path) -> S3Tier:
        keys = key_file(tmp_path / "keys", self.bucket.credentials)
        return s3_tier(self.bucket.endpoint, self.bucket.name, keys)

    def make_peer(self, tier: SharedTier) -> SharedTier:
        assert isinstance(tier, S3Tier)
        return peer_of(tier)


# ---------------------------------------------------------------------- layout


def raw_keys(bucket: Bucket, prefix: str = "") -> list[str]:
    s3 = bucket.client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket.name, Prefix=prefix)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


@pytest.fixture
def keys(s3_bucket: Bucket, tmp_path: Path) -> Path:
    return key_file(tmp_path / "keys", s3_bucket.credentials)


@pytest.fixture
def tier(s3_bucket: Bucket, keys: Path) -> Iterator[S3Tier]:
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys)
    yield tier
    tier.close()


def test_one_object_per_chunk_and_per_note(s3_bucket: Bucket, tier: S3Tier, keys: Path
                                           ) -> None:
    first, second = key_of("layout one"), key_of("layout two")
    tier.write(first, sealed_in(NAMESPACE, first))
    tier.write(second, sealed_in(OTHER, second))
    tier.put_note("servers/node-a", b"alive")
    assert raw_keys(s3_bucket) == sorted([
        f"kvtier/{chunk_name(NAMESPACE, first)}", f"kvtier/{chunk_name(OTHER, second)}",
        "kvtier/notes/servers/node-a"])
    assert chunk_name(NAMESPACE, first) == (
        f"chunks/{NAMESPACE.hex()}/{first.hex()[:2]}/{first.hex()}.kvc")
    other_prefix = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys, prefix="elsewhere/x/")
    assert list(other_prefix.scan()) == [] and other_prefix.list_notes("servers/") == []
    assert other_prefix.namespaces() == []


def test_scan_skips_objects_that_are_not_chunks(s3_bucket: Bucket, tier: S3Tier) -> None:
    key = key_of("a real chunk")
    tier.write(key, sealed_chunk(key))
    s3 = s3_bucket.client()
    for stray in (f"kvtier/chunks/{NAMESPACE.hex()}/zz/readme.txt",
                  f"kvtier/chunks/{NAMESPACE.hex()}/00/{key.hex()}.kvc",  # wrong shard
                  f"kvtier/chunks/not-a-namespace/{key.hex()[:2]}/{key.hex()}.kvc",
                  "kvtier/chunks/loose.kvc"):
        s3.put_object(Bucket=s3_bucket.name, Key=stray, Body=b"x")
    assert [c.key for c in tier.scan()] == [key]
    assert tier.namespaces() == [NAMESPACE]


def test_large_chunks_go_up_in_parts(s3_bucket: Bucket, keys: Path) -> None:
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys, multipart_threshold="8MiB",
                   multipart_part_size="5MiB")
    big, small = key_of("twelve MiB"), key_of("one MiB")
    data = sealed_chunk(big, 12 * MiB, seed=3)
    tier.write(big, data)
    tier.write(small, sealed_chunk(small, MiB))
    assert read_back(tier, big, len(data)) == data
    s3 = s3_bucket.client()
    etag = s3.head_object(Bucket=s3_bucket.name,
                          Key=f"kvtier/{chunk_name(NAMESPACE, big)}")["ETag"]
    assert etag.strip('"').endswith("-3"), "12 MiB + a header page in 5 MiB parts: 3 parts"
    etag = s3.head_object(Bucket=s3_bucket.name,
                          Key=f"kvtier/{chunk_name(NAMESPACE, small)}")["ETag"]
    assert "-" not in etag, "below the threshold: one PUT"
    assert s3.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", []) == []
    tier.close()


def test_an_unfinished_upload_is_never_served_and_is_cleaned_when_stale(
        s3_bucket: Bucket, tier: S3Tier) -> None:
    key = key_of("killed mid-upload")
    name = f"kvtier/{chunk_name(NAMESPACE, key)}"
    s3 = s3_bucket.client()
    # what a writer killed between its parts leaves: an upload never completed
    upload = s3.create_multipart_upload(Bucket=s3_bucket.name, Key=name)["UploadId"]
    s3.upload_part(Bucket=s3_bucket.name, Key=name, UploadId=upload, PartNumber=1,
                   Body=bytes(sealed_chunk(key, 6 * MiB))[: 5 * MiB])
    outside = s3.create_multipart_upload(Bucket=s3_bucket.name, Key="not-kvtier/x")["UploadId"]
    try:
        assert tier.read_into(key, page_buffer(8 * MiB), namespace=NAMESPACE) is None
        assert list(tier.scan()) == []
        assert tier.clean_stale_temps(3600) == 0, "young: it could be a write in flight"
        time.sleep(1.2)  # the server keeps whole seconds
        assert tier.clean_stale_temps(0.5) == 1
        left = s3.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", [])
        assert [u["Key"] for u in left] == ["not-kvtier/x"], "only the tier's own prefix"
    finally:
        s3.abort_multipart_upload(Bucket=s3_bucket.name, Key="not-kvtier/x", UploadId=outside)


def test_touch_keeps_the_bytes_and_creates_nothing(s3_bucket: Bucket, tier: S3Tier) -> None:
    key, missing = key_of("touched"), key_of("touched but never written")
    data = sealed_chunk(key, seed=4)
    tier.write(key, data)
    tier.touch(key, namespace=NAMESPACE)
    tier.touch(missing, namespace=NAMESPACE)
    assert read_back(tier, key, len(data)) == data
    assert raw_keys(s3_bucket) == [f"kvtier/{chunk_name(NAMESPACE, key)}"]


def test_a_corrupted_object_is_returned_and_fails_verification(s3_bucket: Bucket,
                                                               tier: S3Tier) -> None:
    """The tier only stores bytes; the store verifies them and turns this into a miss."""
    key = key_of("corrupted")
    data = sealed_chunk(key, seed=5)
    tier.write(key, data)
    s3, name = s3_bucket.client(), f"kvtier/{chunk_name(NAMESPACE, key)}"
    flipped = bytearray(data)
    flipped[codec.HEADER_SIZE + 1000] ^= 0xFF  # one bit of payload
    for garbage in (os.urandom(len(data)), bytes(data)[: len(data) // 2], bytes(flipped)):
        s3.put_object(Bucket=s3_bucket.name, Key=name, Body=garbage)
        dst = page_buffer(len(data))
        assert tier.read_into(key, dst, namespace=NAMESPACE) == len(garbage)
        assert dst[: len(garbage)] == garbage
        with pytest.raises(CorruptChunkError):
            codec.verify(dst[: len(garbage)], key, NAMESPACE)


def test_parallel_transfers_are_bounded(s3_bucket: Bucket, keys: Path) -> None:
    tier = s3_tier(s3_bucket.endpoint, s3_bucket.name, keys, max_connections=2)
    chunks = {key_of(f"parallel {i}"): sealed_chunk(key_of(f"parallel {i}"), MiB, seed=i)
              for i in range(16)}
    active, peak, lock = [0], [0], threading.Lock()

    def begin(**_: object) -> None:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])

    def end(**_: object) -> None:
        with lock:
            active[0] -= 1

    tier._client.meta.events.register("before-call.s3", begin)
    tier._client.meta.events.register("after-call.s3", end)
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda kv: tier.write(*kv), chunks.items()))
        got = list(pool.map(lambda k: read_back(tier, k, len(chunks[k])), chunks))
    assert got == list(chunks.values())
    assert peak[0] == 2, f"8 threads, 2 connections: {peak[0]} calls were in flight at once"
    tier.close()


def test_describe_names_where_and_how_but_no_secret(s3_bucket: Bucket, tier: S3Tier,
                                                    keys: Path) -> None:
    facts = tier.describe()
    assert facts | {"endpoint": s3_bucket.endpoint, "bucket": s3_bucket.name,
                    "prefix": "kvtier/", "addressing": "auto", "tls": False,
                    "credentials": f"file:{keys}", "shared": True} == facts
    secret = s3_bucket.credentials.secret_key
    assert secret not in repr(facts) and secret not in repr(tier.options)
    assert tier.space() is None
