"""``kvtier bench shared``: the shared tiers against their plain client libraries, one run.

For each backend (a folder or mount for ``fs``; SeaweedFS S3 and ``redis-server`` started on
loopback by the bench unless endpoints are given):

- throughput: the tier's chunk writes and reads against the plain library doing the same work
  with the same sizes on the same server (``*_write_ratio``, ``*_read_ratio``; target >= 0.8):
  file ``write`` + ``fsync`` and ``readinto`` (both from a cold page cache: the tier reads with
  O_DIRECT) for fs, boto3 ``put_object``/``get_object`` for s3, redis-py ``SET``/``GET`` for
  redis, redis-py ``RedisCluster`` ``SET``/``GET`` for ``redis_cluster`` (a 3-primary Redis
  Cluster with a replica each; not in the default list; target >= 0.9);
- lookup: a 128K-token prompt (512 chunks) fully present on the shared tier, written by one
  kvtier server and looked up through another server's socket, p50 (``*_lookup_128k_ms``;
  targets: s3 <= 20, fs and redis <= 5), next to what asking the backend per chunk would cost
  (a stat / HEAD / EXISTS each); and how long after the writer committed the reader found all
  512 (``*_visible_s``: the journal's delay);
- trust: reads verified with the cluster secret's MAC against the checksum alone, on the same
  objects (``*_auth_read_ratio``; target >= 0.9; :mod:`kvtier.bench.auth`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import codec
from kvtier.bench import pagecache
from kvtier.bench.report import Row, print_table
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig, TierConfig, parse_size
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.server import NodeServer
from kvtier.tiers import LowerTier

NS = b"\x33" * 32
MiB = 1 << 20
CHUNKS = 512
SHARING = {"journal_interval_s": 0.1, "poll_s": 0.2, "sweep_interval_s": 3600}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("shared", help="fs, s3 and redis tiers against their plain clients")
    p.add_argument("--backends", default="fs,s3,redis",
                   help="comma-separated of fs, s3, redis, redis_cluster (default: fs,s3,redis)")
    p.add_argument("--fs-path", help="folder for the fs tier (default: a temp dir; give a "
                   "shared mount to measure it)")
    p.add_argument("--s3-endpoint", help="an S3 endpoint to use (default: start SeaweedFS); "
                   "credentials from AWS_* in the environment")
    p.add_argument("--s3-bucket", help="bucket to use with --s3-endpoint")
    p.add_argument("--redis-url", help="a Redis to use (default: start redis-server)")
    p.add_argument("--redis-cluster-url", help="a node of a Redis Cluster to use with the "
                   "redis_cluster backend (default: start 3 primaries + 3 replicas)")
    p.add_argument("--sizes", default="1MiB,4MiB", help="chunk sizes")
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s.strip(), "--sizes") for s in args.sizes.split(",")]
    figures: dict[str, float] = {}
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-shared-")))
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            tier = _backend(backend, args, tmp, stack)
            b_rows, b_figs = _throughput(backend, tier, sizes)
            l_rows, l_figs = lookup(backend, tier, tmp / f"lookup-{backend}")
            a_rows, a_figs = _auth(backend, tier, sizes[0])
            rows += b_rows + l_rows + a_rows
            figures.update(b_figs | l_figs | a_figs)
    print_table(rows, title="kvtier bench shared (tier vs plain client, same run)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


def _backend(backend: str, args: argparse.Namespace, tmp: Path,
             stack: contextlib.ExitStack) -> dict[str, Any]:
    """The tier config for ``backend`` (starting its service when needed)."""
    if backend == "fs":
        path = Path(args.fs_path) if args.fs_path else tmp / "fs"
        return {"type": "fs", "options": {"path": str(path / "kvtier-bench")}}
    if backend in ("s3", "redis", "redis_cluster"):
        from kvtier.bench import shared_services

        return shared_services.tier_config(backend, args, tmp, stack)
    raise SystemExit(f"kvtier bench shared: unknown backend {backend!r}; use fs, s3, redis, "
                     "redis_cluster")


# ---------------------------------------------------------------------- throughput

def _throughput(backend: str, tier: dict[str, Any], sizes: list[int]
                ) -> tuple[list[Row], dict[str, float]]:
    if backend == "fs":
        return fs_throughput(Path(tier["options"]["path"]), sizes)
    from kvtier.bench import shared_services

    return shared_services.throughput(backend, tier, sizes)


def fs_throughput(path: Path, sizes: list[int], count: int = 16, rounds: int = 5
                  ) -> tuple[list[Row], dict[str, float]]:
    from kvtier.tiers.fs import FsTier

    config = TierConfig(type="fs", name="fs", capacity_bytes=1 << 40,
                        options={"path": str(path)})
    tier = FsTier.from_config("fs", config)
    plain = path.parent / "plain"
    plain.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    w_ratios, r_ratios, figures = [], [], {}
    try:
        for size in sizes:
            with _chunk(size) as (view, into):
                keys = chunk_keys(NS, np.arange(count * 16, dtype=np.int32) + size, 16)
                files = [plain / f"{i}" for i in range(count)]
                write = _median(rounds, _each(keys, functools.partial(_tier_write, tier, view)))
                read = _median(rounds, _cold(path, _each(
                    keys, functools.partial(_tier_read, tier, into))))
                p_write = _median(rounds, _each(files, functools.partial(_plain_write,
                                                                         view=view)))
                p_read = _median(rounds, _cold(plain, _each(
                    files, functools.partial(_plain_read, into=into))))
            total = count * codec.stored_size(size) / 1e9
            label = f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"
            rows += [Row(f"fs write {label} GB/s", total / write, total / p_write, "write+fsync"),
                     Row(f"fs read {label} GB/s", total / read, total / p_read, "readinto")]
            w_ratios.append(p_write / write)
            r_ratios.append(p_read / read)
            figures[f"fs_write_gb_per_s_{label.replace(' ', '')}"] = total / write
            figures[f"fs_read_gb_per_s_{label.replace(' ', '')}"] = total / read
    finally:
        tier.close()
    figures["fs_write_ratio"] = statistics.median(w_ratios)
    figures["fs_read_ratio"] = statistics.median(r_ratios)
    return rows, figures


def _each(items: list[Any], fn: Callable[[Any], object]) -> Callable[[], None]:
    def run() -> None:
        for item in items:
            fn(item)
    return run


def _cold(folder: Path, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with the files under ``folder`` evicted from the page cache first (the tier
    reads with O_DIRECT: a warm-cache baseline would compare RAM with the disk)."""
    def run() -> None:
        pagecache.evict(folder)
        fn()
    return run


def _tier_write(tier: LowerTier, view: memoryview, key: ChunkKey) -> None:
    tier.write(key, view)


def _tier_read(tier: LowerTier, into: memoryview, key: ChunkKey) -> None:
    tier.read_into(key, into, namespace=NS)


def _plain_write(path: Path, view: memoryview) -> None:
    with open(path, "wb") as f:
        f.write(view)
        f.flush()
        os.fsync(f.fileno())


def _plain_read(path: Path, into: memoryview) -> None:
    with open(path, "rb") as f:
        f.readinto(into)


@contextlib.contextmanager
def _chunk(size: int) -> Iterator[tuple[memoryview, memoryview]]:
    """A sealed chunk of ``size`` payload bytes in a page-aligned buffer, and room to read."""
    stored = codec.stored_size(size)
    buf = mmap.mmap(-1, 2 * stored)
    view, into = memoryview(buf)[:stored], memoryview(buf)[stored:]
    np.frombuffer(buf, dtype=np.uint8)[codec.HEADER_SIZE:stored] = 7
    codec.seal(view, NS, ChunkKey(b"\x01" * 32), tokens=16, payload_len=size)
    try:
        yield view, into
    finally:
        view.release()
        into.release()
        with contextlib.suppress(BufferError):
            buf.close()


def _median(rounds: int, fn: Callable[[], None]) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _auth(backend: str, config: dict[str, Any], size: int
          ) -> tuple[list[Row], dict[str, float]]:
    from kvtier.bench import auth

    tier = auth.tier_from(config)
    try:
        return auth.auth_read(backend, tier, size)
    finally:
        tier.close()


# ---------------------------------------------------------------------- lookup

def lookup(backend: str, tier: dict[str, Any], root: Path, chunks: int = CHUNKS,
           repeats: int = 200) -> tuple[list[Row], dict[str, float]]:
    """One server writes ``chunks`` chunks of a prompt to the shared tier, another looks the
    prompt up: time until it sees all of them, then lookups p50 through its socket."""
    payload = 4096
    root.mkdir(parents=True, exist_ok=True)
    keys = chunk_keys(NS, np.arange(chunks * 256, dtype=np.int32), 256)
    writer, reader = (_node(root / name, tier, chunks, payload) for name in ("w", "r"))
    with writer, reader:
        client_w = KvtierClient(writer.socket_path, name="bench-writer")
        client_r = KvtierClient(reader.socket_path, name="bench-reader")
        slots = client_w.reserve(NS, keys, payload_len=payload, tokens=256)
        assert all(s is not None for s in slots)
        client_w.commit(keys)
        assert writer.store is not None and writer.store.flush(120)
        committed = time.monotonic()
        while len(client_r.lookup(keys)) < chunks and time.monotonic() - committed < 60:
            time.sleep(0.01)
        visible = time.monotonic() - committed
        assert len(client_r.lookup(keys)) == chunks, "the reader never saw the writes"
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            client_r.lookup(keys)
            times.append(time.perf_counter() - start)
        naive = _naive_probe(backend, reader, keys)
        client_w.close()
        client_r.close()
    p50 = statistics.median(times) * 1e3
    rows = [Row(f"{backend} lookup 128K tokens, p50 ms", p50, naive * 1e3,
                "ask the backend per chunk"),
            Row(f"{backend} seen by another server after, s", visible, None, "")]
    return rows, {f"{backend}_lookup_128k_ms": p50, f"{backend}_probe_128k_ms": naive * 1e3,
                  f"{backend}_visible_s": visible}


def _node(root: Path, tier: dict[str, Any], chunks: int, payload: int) -> NodeServer:
    slot = codec.stored_size(payload)
    options = {**tier.get("options", {}), **SHARING}
    tier = {k: v for k, v in tier.items() if not k.startswith("_")}
    config = ServerConfig.from_dict({
        "socket_path": str(root / "kvtier.sock"),
        "arena": {"size_bytes": (chunks + 8) * slot, "slot_bytes": slot, "free_target": 0.0},
        "tiers": [{**tier, "name": "shared", "capacity_bytes": 16 << 30,
                   "io_threads": 8, "options": options}],
    })
    return NodeServer(config)


def _naive_probe(backend: str, server: NodeServer, keys: list[ChunkKey]) -> float:
    """What one existence check per chunk against the backend costs (the baseline)."""
    assert server.store is not None
    tier = server.store.tiers[0].tier
    start = time.perf_counter()
    buf = memoryview(bytearray(codec.HEADER_SIZE))
    for key in keys:
        with contextlib.suppress(Exception):  # a too-small buffer: the object exists
            tier.read_into(key, buf, namespace=NS)
    return time.perf_counter() - start
