"""The redis tier against plain redis-py on the same server, side by side in one run.

For each value size: the tier's ``write`` (SET + index in one MULTI/EXEC) against a plain
``SET`` of the same bytes, and the tier's ``read_into`` (GET + one copy into the slot) against a
plain ``GET``. The two take turns call by call, so changes of load on the machine cancel out of
the ratios; the headline ``redis_read_ratio`` and ``redis_write_ratio`` are the worst
size's (target >= 0.8). With ``cluster``: the tier with ``cluster: true`` against redis-py's
``RedisCluster`` on a Redis Cluster, figures named ``redis_cluster_*`` (target >= 0.9).

    python -m kvtier.bench.shared_redis [--url redis://...] [--cluster] [--json FILE]

Without ``--url`` it starts its own redis-server (or a 3-primary cluster with 3 replicas) on
loopback. Needs the ``shared`` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import secrets
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.report import Row, print_table
from kvtier.codec import HEADER_SIZE, PAGE, seal
from kvtier.config import TierConfig
from kvtier.keys import ChunkKey

MiB = 1 << 20
NS = b"\x22" * 32


def bench_redis(url: str | None = None, *, sizes: Sequence[int] = (MiB, 4 * MiB),
                count: int = 16, repeats: int = 5, cluster: bool = False) -> dict[str, float]:
    """Figures (MB/s and ratios) for each size in ``sizes`` (stored bytes, page multiples)."""
    name = "redis_cluster" if cluster else "redis"
    with contextlib.ExitStack() as stack:
        if url is None:
            from kvtier.services import RedisCluster, RedisServer

            service: Any = RedisCluster() if cluster else RedisServer()
            url = stack.enter_context(service).url
        figures: dict[str, float] = {}
        for size in sizes:
            figures.update(_one_size(url, size, count, repeats, cluster))
    figures = {name + k.removeprefix("redis"): v for k, v in figures.items()}
    for kind in ("read", "write"):
        figures[f"{name}_{kind}_ratio"] = min(figures[f"{name}_{kind}_ratio_{_label(s)}"]
                                              for s in sizes)
    return figures


def rows(figures: dict[str, float], sizes: Sequence[int] = (MiB, 4 * MiB), *,
         cluster: bool = False) -> list[Row]:
    """Table rows (MB/s, tier against plain redis-py) for :func:`print_table`."""
    name, plain = ("redis_cluster", "RedisCluster ") if cluster else ("redis", "")
    out = []
    for size in sizes:
        label = _label(size)
        out += [Row(f"{name} write {label}", figures[f"{name}_tier_write_MBps_{label}"],
                    figures[f"{name}_plain_set_MBps_{label}"], f"redis-py {plain}SET"),
                Row(f"{name} read {label}", figures[f"{name}_tier_read_MBps_{label}"],
                    figures[f"{name}_plain_get_MBps_{label}"], f"redis-py {plain}GET")]
    return out


def _one_size(url: str, size: int, count: int, repeats: int, cluster: bool
              ) -> dict[str, float]:
    import redis

    from kvtier.tiers.redis import RedisTier

    if size % PAGE or size <= HEADER_SIZE:
        raise ValueError(f"size {size}: a multiple of {PAGE} above the header page")
    prefix = f"kvtier-bench-{secrets.token_hex(4)}:"
    tier = RedisTier("bench", TierConfig(type="redis", name="bench", capacity_bytes=1 << 40,
                                         options={"url": url, "key_prefix": prefix,
                                                  "cluster": cluster}))
    client: Any = (redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url))
    keys = [ChunkKey(secrets.token_bytes(32)) for _ in range(count)]
    with _sealed(size) as (chunk, dst):
        body = bytes(chunk)
        plain_keys = [f"{prefix}plain:{i}" for i in range(count)]

        def tier_write(i: int) -> None:
            tier.write(keys[i], chunk)

        def plain_set(i: int) -> None:
            client.set(plain_keys[i], body)

        def tier_read(i: int) -> None:
            tier.read_into(keys[i], dst, namespace=NS)

        def plain_get(i: int) -> None:
            client.get(plain_keys[i])

        try:
            times = _interleaved([(plain_set, tier_write), (plain_get, tier_read)], count,
                                 repeats)
            assert dst[:size] == chunk, "the tier read back other bytes"
        finally:
            for key in keys:
                tier.delete(key, namespace=NS)
            for plain_key in plain_keys:  # one by one: on a cluster they span slots
                client.delete(plain_key)
            tier.reconcile()
            tier.close()
            client.close()
    rate = {name: count * size / statistics.median(t) / 1e6 for name, t in times.items()}
    label = _label(size)
    return {f"redis_plain_set_MBps_{label}": rate["plain_set"],
            f"redis_tier_write_MBps_{label}": rate["tier_write"],
            f"redis_plain_get_MBps_{label}": rate["plain_get"],
            f"redis_tier_read_MBps_{label}": rate["tier_read"],
            f"redis_write_ratio_{label}": rate["tier_write"] / rate["plain_set"],
            f"redis_read_ratio_{label}": rate["tier_read"] / rate["plain_get"]}


Step = Callable[[int], None]


def _interleaved(pairs: list[tuple[Step, Step]], count: int, repeats: int
                 ) -> dict[str, list[float]]:
    """Seconds per batch of ``count`` calls of each step. The two steps of a pair take turns
    call by call (first one, then the other), so a change of load on the machine hits both."""
    times: dict[str, list[float]] = {s.__name__: [] for pair in pairs for s in pair}
    for rep in range(repeats):
        for pair in pairs:
            spent = dict.fromkeys((s.__name__ for s in pair), 0.0)
            for i in range(count):
                for step in pair if (i + rep) % 2 == 0 else pair[::-1]:
                    start = time.perf_counter()
                    step(i)
                    spent[step.__name__] += time.perf_counter() - start
            for name, seconds in spent.items():
                times[name].append(seconds)
    return times


@contextlib.contextmanager
def _sealed(size: int) -> Iterator[tuple[memoryview, memoryview]]:
    """A sealed chunk of ``size`` stored bytes and a slot-like buffer to read into."""
    src, dst = mmap.mmap(-1, size), mmap.mmap(-1, size)
    chunk, out = memoryview(src), memoryview(dst)
    payload = size - HEADER_SIZE
    np.frombuffer(src, dtype=np.uint8)[HEADER_SIZE:] = np.random.default_rng(0).integers(
        0, 256, payload, dtype=np.uint8)
    seal(chunk, NS, ChunkKey(b"\x01" * 32), tokens=16, payload_len=payload)
    try:
        yield chunk, out
    finally:
        chunk.release()
        out.release()
        src.close()
        dst.close()


def _label(size: int) -> str:
    return f"{size // MiB}MiB" if size % MiB == 0 else f"{size // 1024}KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The redis tier against plain redis-py.")
    parser.add_argument("--url", help="a Redis to use (default: start one on loopback)")
    parser.add_argument("--cluster", action="store_true",
                        help="a Redis Cluster (default: start 3 primaries + 3 replicas)")
    parser.add_argument("--count", type=int, default=16, help="values per timed batch")
    parser.add_argument("--repeats", type=int, default=5, help="batches (median reported)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    figures = bench_redis(args.url, count=args.count, repeats=args.repeats,
                          cluster=args.cluster)
    name = "redis_cluster" if args.cluster else "redis"
    print_table(rows(figures, cluster=args.cluster),
                title=f"redis tier vs redis-py, MB/s ({args.count} values per batch, median "
                      f"of {args.repeats})")
    print(f"{name}_read_ratio {figures[f'{name}_read_ratio']:.2f}  "
          f"{name}_write_ratio {figures[f'{name}_write_ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
