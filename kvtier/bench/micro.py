"""``kvtier bench micro``: the data path against plain baselines, side by side, one run.

Each figure is kvtier's throughput over a baseline's, measured in the same process on the
same bytes, so machine noise cancels out of the ratios:

- arena write/read: reserve -> copy into slots -> commit (lease -> copy out -> release) over
  the control socket, against ``numpy.copyto`` of the same chunks, one at a time, between two
  touched buffers (the copy any offload path makes); one ``copyto`` of the whole batch is shown
  as a reference: glibc switches to non-temporal stores above a few MiB, which a 1 MiB chunk
  copy never gets, so that row is a ceiling, not a like-for-like baseline;
- disk write/read: the disk tier (temp file + fsync + rename; O_DIRECT where it is on) against
  plain ``open/write/fsync`` and ``readinto``; reads are measured cold (both evicted from the
  page cache) and warm;
- lookup: round trip over the socket for a 128K-token prompt (512 keys, all hits);
- housekeeping: the longest store-lock hold of expiry, clients leaving and coming back and
  the other periodic work, with 1M chunks indexed (:mod:`kvtier.bench.housekeeping`);
- key hashing: bytes of int32 token ids chained through sha256 per second;
- trust (:mod:`kvtier.bench.auth`): a shared folder's reads verified with the cluster secret's
  MAC against the checksum alone (``fs_auth_read_ratio``, page cache warm: the hardest case),
  and the longest store-lock hold applying a hostile 20 MB journal note and a full valid one
  (``note_apply_lock_ms``);
- flood (:mod:`kvtier.bench.flood`): a lookup's p50 and longest wait while a peer process
  floods the journal at the caps, against lookups with no flood, phases interleaved.

``--cases`` runs some of them only (``--cases flood``).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import auth, flood, housekeeping, pagecache
from kvtier.bench.report import Row, print_table
from kvtier.client import KvtierClient
from kvtier.codec import HEADER_SIZE, seal, stored_size
from kvtier.config import ArenaConfig, ServerConfig, TierConfig
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.server import NodeServer

NS = b"\x11" * 32
CASES = ("arena", "disk", "lookup", "housekeeping", "trust", "flood", "hash")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("micro", help="arena, disk, lookup and hashing against plain baselines")
    p.add_argument("--chunk-mib", type=float, default=1.0, help="payload per chunk (MiB)")
    p.add_argument("--chunks", type=int, default=64, help="chunks per timed batch")
    p.add_argument("--repeats", type=int, default=7, help="timed batches (median is reported)")
    p.add_argument("--dir", default=None, help="folder for the disk tier (default: a temp dir)")
    p.add_argument("--housekeeping-chunks", type=int, default=1_000_000,
                   help="chunks indexed for the housekeeping figure")
    p.add_argument("--flood-repeats", type=int, default=3,
                   help="quiet and flooded phases of the flood case (interleaved)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated cases to run, of: {', '.join(CASES)}")
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.set_defaults(func=run)


def _cases(text: str) -> set[str]:
    chosen = {c.strip() for c in text.split(",") if c.strip()}
    unknown = chosen - set(CASES)
    if unknown or not chosen:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; choose from {', '.join(CASES)}")
    return chosen


def run(args: argparse.Namespace) -> int:
    payload = int(args.chunk_mib * (1 << 20)) // 4096 * 4096
    cases = _cases(args.cases)
    figures: dict[str, Any] = {}
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        runs: dict[str, Callable[[], tuple[list[Row], dict[str, Any]]]] = {
            "arena": lambda: _bench_arena(root, payload, args.chunks, args.repeats),
            "disk": lambda: _bench_disk(root, payload, args.chunks, args.repeats),
            "lookup": lambda: _bench_lookup(root),
            "housekeeping": lambda: housekeeping.bench(root, args.housekeeping_chunks),
            "trust": lambda: _bench_trust(root, payload),
            "flood": lambda: flood.bench(root / "flood", args.flood_repeats),
            "hash": _bench_hash}
        for case in CASES:
            if case in cases:
                case_rows, case_figs = runs[case]()
                rows += case_rows
                figures.update(case_figs)
    figures["chunk_bytes"] = payload
    print_table(rows, title=f"kvtier bench micro ({payload >> 10} KiB chunks, "
                            f"{args.chunks} per batch, median of {args.repeats})")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


def _median_gbps(nbytes: int, repeats: int, fn: Callable[[int], None]) -> float:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _server(tmp: Path, slots: int, slot_bytes: int, tag: str,
            tiers: tuple[TierConfig, ...] = ()) -> NodeServer:
    config = ServerConfig(socket_path=str(tmp / f"{tag}.sock"), tiers=tiers,
                          arena=_arena(slots, slot_bytes))
    return NodeServer(config)


def _arena(slots: int, slot_bytes: int) -> ArenaConfig:
    return ArenaConfig(size_bytes=slots * slot_bytes, slot_bytes=slot_bytes, free_target=0.0)


def _keys(tag: int, n: int) -> list[ChunkKey]:
    return chunk_keys(NS, np.arange(n * 16, dtype=np.int32) + tag * 1_000_003, 16)


def _bench_arena(tmp: Path, payload: int, n: int, repeats: int
                 ) -> tuple[list[Row], dict[str, float]]:
    src = np.random.default_rng(0).integers(0, 255, (n, payload), dtype=np.uint8)
    dst = np.ones_like(src)
    total = n * payload
    with _server(tmp, 2 * n + 2, stored_size(payload), "arena") as server:
        client = KvtierClient(server.socket_path, name="bench")
        client.arena.array[:] = 1  # map and touch the pages in this process too

        def write(i: int) -> None:
            keys = _keys(i, n)
            slots = client.reserve(NS, keys, payload_len=payload, tokens=16)
            for row, slot in enumerate(slots):
                assert slot is not None
                np.copyto(client.payload_view(slot, payload), src[row])
            client.commit(keys)

        def read(i: int) -> None:
            lease = client.lease(_keys(repeats - 1, n))
            for row, slot in enumerate(lease.slots):
                np.copyto(dst[row], client.payload_view(slot, payload))
            client.release(lease.lease_id)

        def plain(_i: int) -> None:
            for row in range(n):
                np.copyto(dst[row], src[row])

        def whole(_i: int) -> None:
            np.copyto(dst, src)

        base = _median_gbps(total, repeats, plain)
        ceiling = _median_gbps(total, repeats, whole)
        w = _median_gbps(total, repeats, write)
        r = _median_gbps(total, repeats, read)
        assert np.array_equal(dst, src)
        client.close()
    rows = [Row("arena write (reserve+copy+commit)", w, base, "memcpy per chunk"),
            Row("arena read (lease+copy+release)", r, base, "memcpy per chunk"),
            Row("memcpy per chunk (GB/s)", base, ceiling, "memcpy whole batch")]
    return rows, {"arena_write_gb_per_s": w, "arena_read_gb_per_s": r, "memcpy_gb_per_s": base,
                  "memcpy_batch_gb_per_s": ceiling,
                  "arena_write_ratio": w / base, "arena_read_ratio": r / base}


def _bench_disk(tmp: Path, payload: int, n: int, repeats: int
                ) -> tuple[list[Row], dict[str, float]]:
    from kvtier.tiers.disk import DiskTier

    size = stored_size(payload)
    tier_cfg = TierConfig(type="disk", capacity_bytes=1 << 40, options={"path": str(tmp / "d")})
    tier = DiskTier.from_config("disk", tier_cfg)
    plain_dir = tmp / "plain"
    plain_dir.mkdir()
    buf = mmap.mmap(-1, size)
    view = memoryview(buf)
    np.frombuffer(buf, dtype=np.uint8)[HEADER_SIZE:] = 7
    keys = _keys(99, n)
    seal(view, NS, keys[0], 16, payload)
    total = n * size
    reps = max(2, repeats // 2)

    def tier_write(_i: int) -> None:
        for key in keys:
            tier.write(key, view)

    def plain_write(_i: int) -> None:
        for j in range(n):
            with open(plain_dir / f"{j}.bin", "wb") as f:
                f.write(view)
                f.flush()
                os.fsync(f.fileno())

    def tier_read(_i: int) -> None:
        for key in keys:
            tier.read_into(key, view, namespace=NS)

    def plain_read(_i: int) -> None:
        for j in range(n):
            with open(plain_dir / f"{j}.bin", "rb") as f:
                f.readinto(view)

    def cold(fn: Callable[[int], None], root: Path) -> Callable[[int], None]:
        def wrapped(i: int) -> None:
            pagecache.evict(root)
            fn(i)
        return wrapped

    pw = _median_gbps(total, reps, plain_write)
    tw = _median_gbps(total, reps, tier_write)
    prc = _median_gbps(total, reps, cold(plain_read, plain_dir))
    trc = _median_gbps(total, reps, cold(tier_read, tmp / "d"))
    prw = _median_gbps(total, reps, plain_read)
    trw = _median_gbps(total, reps, tier_read)
    o_direct = tier.describe().get("o_direct")
    tier.close()
    view.release()
    buf.close()
    rows = [Row(f"disk write+fsync (o_direct={o_direct})", tw, pw, "write+fsync"),
            Row("disk read, cold page cache", trc, prc, "readinto"),
            Row("disk read, warm page cache", trw, prw, "readinto")]
    figs = {"disk_write_gb_per_s": tw, "plain_write_gb_per_s": pw,
            "disk_read_gb_per_s": trc, "plain_read_gb_per_s": prc,
            "disk_write_ratio": tw / pw, "disk_read_ratio": trc / prc,
            "disk_read_warm_ratio": trw / prw}
    return rows, figs


def _bench_trust(tmp: Path, payload: int) -> tuple[list[Row], dict[str, float]]:
    tier = auth.tier_from({"type": "fs", "options": {"path": str(tmp / "auth")}})
    try:
        rows, figures = auth.auth_read("fs", tier, payload)
    finally:
        tier.close()
    note_rows, note_figs = auth.note_apply_lock(tmp / "note")
    return rows + note_rows, figures | note_figs


def _bench_lookup(tmp: Path) -> tuple[list[Row], dict[str, float]]:
    n, payload = 512, 4096
    with _server(tmp, n + 8, stored_size(payload), "lookup") as server:
        client = KvtierClient(server.socket_path, name="bench")
        keys = chunk_keys(NS, np.arange(n * 256, dtype=np.int32), 256)
        slots = client.reserve(NS, keys, payload_len=payload, tokens=256)
        assert all(s is not None for s in slots)
        client.commit(keys)
        times = []
        for _ in range(1000):
            start = time.perf_counter()
            hit = client.lookup(keys)
            times.append(time.perf_counter() - start)
        assert len(hit) == n
        client.close()
    times.sort()
    p50, p99 = times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6
    rows = [Row("lookup 128K tokens (512 keys), p50 us", p50, None, ""),
            Row("lookup 128K tokens (512 keys), p99 us", p99, None, "")]
    return rows, {"lookup_p50_us": p50, "lookup_p99_us": p99}


def _bench_hash() -> tuple[list[Row], dict[str, float]]:
    tokens = np.random.default_rng(1).integers(0, 128_000, 1 << 20, dtype=np.int32)
    start = time.perf_counter()
    rounds = 8
    for _ in range(rounds):
        chunk_keys(NS, tokens, 256)
    gbps = rounds * tokens.nbytes / (time.perf_counter() - start) / 1e9
    return [Row("key hashing (sha256 chain), GB/s", gbps, None, "")], {"hash_gb_per_s": gbps}
