"""Baselines of the shared stores with their plain client libraries, measured in one run.

The denominators for the shared tiers' performance ratios and the inputs of lookup design:
boto3 PUT/GET throughput and HEAD latency against SeaweedFS S3, file I/O and stat() on a
SeaweedFS FUSE mount, redis-py SET/GET and a 512-key EXISTS. Needs the ``shared`` extra.

    python tests/services/baselines.py [--count 64] [--size 1MiB] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.services.mount import SeaweedMount
from kvtier.services.redis_server import RedisServer
from kvtier.services.seaweedfs import SeaweedFS

MiB = 1 << 20
PARALLEL = 8
LOOKUP_KEYS = 512  # a 128K-token prompt in 256-token chunks


def _rate(total_bytes: int, seconds: float) -> float:
    return round(total_bytes / seconds / 1e6, 1)


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` calls."""
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _ms(samples: list[float], q: float) -> float:
    return round(float(np.percentile(samples, q)) * 1e3, 3)


def measure_s3(weed: SeaweedFS, count: int, size: int) -> dict[str, float]:
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=weed.endpoint, config=Config(max_pool_connections=16),
                      **weed.credentials.boto3_kwargs())
    bucket = f"baseline-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    body = os.urandom(size)
    keys = [f"ns/{i:08x}" for i in range(count)]
    s3.put_object(Bucket=bucket, Key="warmup", Body=body)
    start = time.perf_counter()
    for key in keys:
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    get_s = time.perf_counter() - start
    with ThreadPoolExecutor(PARALLEL) as pool:
        start = time.perf_counter()
        list(pool.map(lambda k: s3.put_object(Bucket=bucket, Key=k, Body=body), keys))
        put_par_s = time.perf_counter() - start
        start = time.perf_counter()
        list(pool.map(lambda k: s3.get_object(Bucket=bucket, Key=k)["Body"].read(), keys))
        get_par_s = time.perf_counter() - start
    heads = _timed(lambda: s3.head_object(Bucket=bucket, Key=keys[0]), 300)
    misses = _timed(lambda: _head_missing(s3, bucket), 100)
    for i in range(LOOKUP_KEYS):
        s3.put_object(Bucket=bucket, Key=f"lookup/{i:08x}", Body=b"x")
    lists = _timed(lambda: s3.list_objects_v2(Bucket=bucket, Prefix="lookup/", MaxKeys=1000),
                   10)
    return {"s3_put_MBps": _rate(count * size, put_s), "s3_get_MBps": _rate(count * size, get_s),
            f"s3_put_{PARALLEL}threads_MBps": _rate(count * size, put_par_s),
            f"s3_get_{PARALLEL}threads_MBps": _rate(count * size, get_par_s),
            "s3_head_p50_ms": _ms(heads, 50), "s3_head_p99_ms": _ms(heads, 99),
            "s3_head_miss_p50_ms": _ms(misses, 50),
            "s3_head_512_sequential_ms": round(_ms(heads, 50) * LOOKUP_KEYS, 1),
            "s3_list_512_keys_p50_ms": _ms(lists, 50)}


def _head_missing(s3: Any, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        s3.head_object(Bucket=bucket, Key="no/such/key")
    except ClientError:
        return


def measure_fs(mount: SeaweedMount, other: SeaweedMount, count: int,
               size: int) -> dict[str, float]:
    """``mount`` writes; ``other`` (a second mount of the same folder, as on another node)
    reads cold: nothing of these files is in its page cache or chunk cache."""
    folder = f"baseline-{uuid.uuid4().hex[:8]}"
    root, remote = mount.path / folder, other.path / folder
    root.mkdir()
    body = os.urandom(size)
    paths = [root / f"{i:08x}.kvc" for i in range(count)]
    start = time.perf_counter()
    for path in paths:
        _publish(path, body)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        path.with_suffix(".nosync").write_bytes(body)
    write_nosync_s = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        path.read_bytes()
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    for path in paths:
        (remote / path.name).read_bytes()
    read_cold_s = time.perf_counter() - start
    stats = _timed(lambda: os.stat(paths[0]), 1000)
    missing = _timed(lambda: os.path.exists(root / "missing.kvc"), 1000)
    (root / "lookup").mkdir()
    names = [f"lookup/{i:08x}.kvc" for i in range(LOOKUP_KEYS)]
    for name in names:
        (root / name).write_bytes(b"x")
    start = time.perf_counter()
    for name in names:
        os.stat(remote / name)
    cold_lookup_s = time.perf_counter() - start
    lookups = _timed(lambda: [os.stat(root / n) for n in names], 10)
    return {"fs_write_fsync_rename_MBps": _rate(count * size, write_s),
            "fs_write_nofsync_MBps": _rate(count * size, write_nosync_s),
            "fs_read_warm_MBps": _rate(count * size, read_s),
            "fs_read_cold_other_mount_MBps": _rate(count * size, read_cold_s),
            "fs_stat_p50_ms": _ms(stats, 50), "fs_stat_p99_ms": _ms(stats, 99),
            "fs_stat_missing_p50_ms": _ms(missing, 50),
            "fs_stat_512_p50_ms": _ms(lookups, 50),
            "fs_stat_512_cold_other_mount_ms": round(cold_lookup_s * 1e3, 3)}


def _publish(path: Path, body: bytes) -> None:
    """What the fs tier does: a unique temp name, write, fsync, rename into place."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def measure_redis(server: RedisServer, count: int, size: int) -> dict[str, float]:
    import redis

    r = redis.Redis.from_url(server.url)
    body = os.urandom(size)
    keys = [f"ns:{i:08x}" for i in range(count)]
    start = time.perf_counter()
    for key in keys:
        r.set(key, body)
    set_s = time.perf_counter() - start
    start = time.perf_counter()
    for key in keys:
        r.get(key)
    get_s = time.perf_counter() - start
    lookup = [f"lookup:{i:08x}" for i in range(LOOKUP_KEYS)]
    r.mset({key: b"x" for key in lookup})
    exists = _timed(lambda: r.exists(*lookup), 200)
    pings = _timed(r.ping, 500)
    return {"redis_set_MBps": _rate(count * size, set_s),
            "redis_get_MBps": _rate(count * size, get_s),
            "redis_exists_512_p50_ms": _ms(exists, 50),
            "redis_exists_512_p99_ms": _ms(exists, 99),
            "redis_ping_p50_ms": _ms(pings, 50)}


def run(count: int, size: int) -> dict[str, float]:
    results: dict[str, float] = {"count": count, "size_bytes": size}
    with SeaweedFS() as weed:
        results.update(measure_s3(weed, count, size))
        with SeaweedMount(weed.filer_address) as mount, \
                SeaweedMount(weed.filer_address) as other:
            results.update(measure_fs(mount, other, count, size))
    with RedisServer() as server:
        results.update(measure_redis(server, count, size))
    return results


def _size(text: str) -> int:
    units = {"kib": 1 << 10, "mib": MiB, "kb": 1000, "mb": 1000 * 1000}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Baselines of the shared stores.")
    parser.add_argument("--count", type=int, default=64, help="objects per throughput test")
    parser.add_argument("--size", type=_size, default=MiB, help="object size (e.g. 1MiB)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = run(args.count, args.size)
    for key, value in results.items():
        print(f"{key:32} {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
