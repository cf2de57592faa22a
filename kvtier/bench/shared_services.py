"""The s3 and redis backends of ``kvtier bench shared``: a service started on loopback (or
the endpoint given), the tier's config for it, and its throughput against the plain client."""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from typing import Any

from kvtier.bench.report import Row

MiB = 1 << 20


def tier_config(backend: str, args: argparse.Namespace, tmp: Path,
                stack: contextlib.ExitStack) -> dict[str, Any]:
    if backend == "s3":
        return _s3(args, tmp, stack)
    if backend == "redis_cluster":
        return _redis_cluster(args, stack)
    return _redis(args, stack)


def _s3(args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    from kvtier.services import S3Credentials, SeaweedFS

    if args.s3_endpoint:
        credentials = S3Credentials(os.environ["AWS_ACCESS_KEY_ID"],
                                    os.environ["AWS_SECRET_ACCESS_KEY"])
        endpoint, bucket = args.s3_endpoint, args.s3_bucket or "kvtier-bench"
    else:
        weed = stack.enter_context(SeaweedFS())
        endpoint, credentials, bucket = weed.endpoint, weed.credentials, "kvtier-bench"
    keys = tmp / "s3.keys"
    keys.write_text(f"AWS_ACCESS_KEY_ID={credentials.access_key}\n"
                    f"AWS_SECRET_ACCESS_KEY={credentials.secret_key}\n")
    keys.chmod(0o600)
    return {"type": "s3", "_credentials": credentials,
            "options": {"bucket": bucket, "endpoint_url": endpoint, "create_bucket": True,
                        "tls": endpoint.startswith("https:"), "credentials": f"file:{keys}"}}


def _redis(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    url = args.redis_url
    if url is None:
        from kvtier.services import RedisServer

        url = stack.enter_context(RedisServer()).url
    return {"type": "redis", "options": {"url": url}}


def _redis_cluster(args: argparse.Namespace, stack: contextlib.ExitStack) -> dict[str, Any]:
    url = args.redis_cluster_url
    if url is None:
        from kvtier.services import RedisCluster

        url = stack.enter_context(RedisCluster()).url
    return {"type": "redis", "options": {"url": url, "cluster": True}}


def throughput(backend: str, tier: dict[str, Any], sizes: list[int]
               ) -> tuple[list[Row], dict[str, float]]:
    if backend in ("redis", "redis_cluster"):
        from kvtier.bench.shared_redis import bench_redis, rows

        cluster = backend == "redis_cluster"
        figures = bench_redis(tier["options"]["url"], sizes=sizes, cluster=cluster)
        return rows(figures, sizes, cluster=cluster), figures
    from kvtier.bench.shared_s3 import s3_throughput

    opts = tier["options"]
    figures = s3_throughput(opts["endpoint_url"], tier["_credentials"], sizes=sizes)
    out = []
    for size in sizes:
        tag = f"{size // MiB}mib" if size % MiB == 0 else f"{size // 1024}kib"
        out += [Row(f"s3 write {tag} MB/s", figures[f"s3_tier_write_MBps_{tag}"],
                    figures[f"s3_boto3_put_MBps_{tag}"], "boto3 put_object"),
                Row(f"s3 read {tag} MB/s", figures[f"s3_tier_read_MBps_{tag}"],
                    figures[f"s3_boto3_get_MBps_{tag}"], "boto3 get_object")]
    return out, figures
