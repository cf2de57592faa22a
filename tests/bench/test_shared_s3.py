"""The s3 throughput benchmark runs, on tiny sizes, against the test SeaweedFS, and leaves
nothing behind."""

from __future__ import annotations

import pytest
from service_fixtures import Bucket

from kvtier.bench.shared_s3 import s3_throughput

pytestmark = pytest.mark.services


def test_s3_throughput_figures_side_by_side(s3_bucket: Bucket) -> None:
    figures = s3_throughput(s3_bucket.endpoint, s3_bucket.credentials, bucket=s3_bucket.name,
                            sizes=(16 << 10, 64 << 10), count=3, rounds=2)
    for tag in ("16kib", "64kib"):
        for name in ("s3_tier_write_MBps", "s3_boto3_put_MBps", "s3_tier_read_MBps",
                     "s3_boto3_get_MBps", "s3_write_ratio", "s3_read_ratio"):
            assert figures[f"{name}_{tag}"] > 0
    assert figures["s3_write_ratio"] > 0 and figures["s3_read_ratio"] > 0
    s3 = s3_bucket.client()
    assert s3.list_objects_v2(Bucket=s3_bucket.name).get("KeyCount", 0) == 0


def test_s3_throughput_in_a_bucket_of_its_own(s3_bucket: Bucket) -> None:
    s3 = s3_bucket.client()
    before = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    figures = s3_throughput(s3_bucket.endpoint, s3_bucket.credentials, sizes=(8 << 10,),
                            count=1, rounds=1)
    assert figures["s3_bench_count"] == 1 and figures["s3_read_ratio"] > 0
    assert {b["Name"] for b in s3.list_buckets()["Buckets"]} == before


def test_sizes_must_be_whole_pages_above_the_header(s3_bucket: Bucket) -> None:
    with pytest.raises(ValueError, match="multiples of 4096"):
        s3_throughput(s3_bucket.endpoint, s3_bucket.credentials, bucket=s3_bucket.name,
                      sizes=(4096,))
