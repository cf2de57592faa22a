"""The s3 tier's throughput against plain boto3 on the same server, in one run.

For each object size the tier writes ``count`` sealed chunks from page-aligned buffers (as
from arena slots) and reads them back into one, and a default boto3 client does
``put_object(Body=bytes)`` / ``get_object()["Body"].read()`` of objects of the same size.
In each round the two run back to back (tier first in even rounds, boto3 first in odd ones),
and the round's ratio is boto3's seconds over the tier's for the same bytes (``> 1``: the tier
is faster). A ratio is the median over rounds, so a stall of the shared server spoils one
round, not the figure; ``s3_write_ratio`` / ``s3_read_ratio`` are the median over the rounds
of every size. The tier's reads are not verified here (the store verifies: the codec's cost).

    python -m kvtier.bench.shared_s3 [--sizes 1MiB,4MiB] [--count 8] [--rounds 6] [--json F]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier import codec
from kvtier.config import TierConfig, parse_size
from kvtier.keys import ChunkKey
from kvtier.services import S3Credentials, SeaweedFS
from kvtier.tiers.s3 import S3Tier

MiB = 1 << 20
NS = b"\x5e" * 32
SIZES = (MiB, 4 * MiB)


def s3_throughput(endpoint: str, credentials: S3Credentials, *, bucket: str | None = None,
                  sizes: Sequence[int] = SIZES, count: int = 8, rounds: int = 6
                  ) -> dict[str, float]:
    """Figures for ``sizes`` (bytes, multiples of 4096); a bucket of its own unless given.

    Everything it writes is deleted afterwards (and the bucket, if it made one)."""
    import boto3

    if any(size % codec.PAGE or size <= codec.HEADER_SIZE for size in sizes):
        raise ValueError(f"sizes must be multiples of {codec.PAGE} above {codec.HEADER_SIZE}")
    s3 = boto3.client("s3", endpoint_url=endpoint, **credentials.boto3_kwargs())
    own_bucket = bucket is None
    name = bucket or f"kvtier-bench-{uuid.uuid4().hex[:12]}"
    if own_bucket:
        s3.create_bucket(Bucket=name)
    prefix = f"bench-{uuid.uuid4().hex[:8]}/"
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-s3-") as tmp:
        tier = _tier(endpoint, name, prefix, _key_file(Path(tmp), credentials))
        try:
            figures: dict[str, float] = {"s3_bench_count": count, "s3_bench_rounds": rounds}
            writes: list[float] = []
            reads: list[float] = []
            for size in sizes:
                seconds = _measure_size(tier, s3, name, prefix, size, count, rounds)
                figures.update(_size_figures(size, count, seconds))
                writes += _ratios(seconds, "put")
                reads += _ratios(seconds, "get")
            figures["s3_write_ratio"] = round(statistics.median(writes), 3)
            figures["s3_read_ratio"] = round(statistics.median(reads), 3)
        finally:
            _empty(s3, name, prefix)
            tier.close()
            if own_bucket:
                s3.delete_bucket(Bucket=name)
    return figures


def _tier(endpoint: str, bucket: str, prefix: str, keys: Path) -> S3Tier:
    options = {"bucket": bucket, "prefix": prefix, "endpoint_url": endpoint,
               "tls": endpoint.startswith("https:"), "credentials": f"file:{keys}"}
    tier = S3Tier.from_config("s3", TierConfig(type="s3", capacity_bytes=1 << 40,
                                               options=options))
    assert isinstance(tier, S3Tier)
    return tier


def _key_file(folder: Path, credentials: S3Credentials) -> Path:
    path = folder / "s3.keys"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"AWS_ACCESS_KEY_ID={credentials.access_key}\n"
                f"AWS_SECRET_ACCESS_KEY={credentials.secret_key}\n")
    return path


def _measure_size(tier: S3Tier, s3: Any, bucket: str, prefix: str, size: int, count: int,
                  rounds: int) -> dict[str, list[float]]:
    """Seconds of each round's batch of ``count`` transfers, per operation."""
    chunk = _sealed(size)
    dst = memoryview(mmap.mmap(-1, size))
    body = bytes(chunk)  # boto3's caller has bytes; the tier's has an arena slot
    keys = [ChunkKey(uuid.uuid4().bytes + uuid.uuid4().bytes) for _ in range(count)]
    names = [f"{prefix}baseline/{size}/{i:06d}" for i in range(count)]

    def tier_put() -> None:
        for key in keys:
            tier.write(key, chunk)

    def tier_get() -> None:
        for key in keys:
            if tier.read_into(key, dst, namespace=NS) != size:
                raise RuntimeError("the tier lost a chunk it wrote")

    def boto3_put() -> None:
        for name in names:
            s3.put_object(Bucket=bucket, Key=name, Body=body)

    def boto3_get() -> None:
        for name in names:
            if len(s3.get_object(Bucket=bucket, Key=name)["Body"].read()) != size:
                raise RuntimeError("boto3 read back a short object")

    seconds: dict[str, list[float]] = {op: [] for op in
                                       ("tier_put", "boto3_put", "tier_get", "boto3_get")}
    pairs = ((("tier_put", tier_put), ("boto3_put", boto3_put)),
             (("tier_get", tier_get), ("boto3_get", boto3_get)))
    for pair in pairs:
        for r in range(rounds):
            for op, fn in (pair if r % 2 == 0 else pair[::-1]):
                seconds[op].append(_timed(fn))
    if dst != chunk:
        raise RuntimeError("the tier read back other bytes than it wrote")
    return seconds


def _sealed(size: int) -> memoryview:
    buf = memoryview(mmap.mmap(-1, size))
    payload = size - codec.HEADER_SIZE
    buf[codec.HEADER_SIZE :] = os.urandom(payload)
    codec.seal(buf, NS, ChunkKey(b"\x01" * 32), tokens=256, payload_len=payload)
    return buf


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _size_figures(size: int, count: int, seconds: dict[str, list[float]]) -> dict[str, float]:
    tag = f"{size // MiB}mib" if size % MiB == 0 else f"{size // 1024}kib"
    rate = {op: round(size * count / statistics.median(t) / 1e6, 1)
            for op, t in seconds.items()}
    return {f"s3_tier_write_MBps_{tag}": rate["tier_put"],
            f"s3_boto3_put_MBps_{tag}": rate["boto3_put"],
            f"s3_tier_read_MBps_{tag}": rate["tier_get"],
            f"s3_boto3_get_MBps_{tag}": rate["boto3_get"],
            f"s3_write_ratio_{tag}": round(statistics.median(_ratios(seconds, "put")), 3),
            f"s3_read_ratio_{tag}": round(statistics.median(_ratios(seconds, "get")), 3)}


def _ratios(seconds: dict[str, list[float]], op: str) -> list[float]:
    """Each round's boto3 seconds over the tier's."""
    return [b / t for b, t in zip(seconds[f"boto3_{op}"], seconds[f"tier_{op}"], strict=True)]


def _empty(s3: Any, bucket: str, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])


def s3_throughput_local(**kwargs: Any) -> dict[str, float]:
    """:func:`s3_throughput` against a SeaweedFS of its own on loopback."""
    with SeaweedFS() as weed:
        return s3_throughput(weed.endpoint, weed.credentials, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1MiB,4MiB", help="object sizes, comma separated")
    parser.add_argument("--count", type=int, default=8, help="objects per timed batch")
    parser.add_argument("--rounds", type=int, default=6, help="batches per side (alternating)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    figures = s3_throughput_local(sizes=sizes, count=args.count, rounds=args.rounds)
    for key, value in figures.items():
        print(f"{key:32} {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
