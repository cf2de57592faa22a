"""What trusting nothing costs: the authenticated read path and the journal's lock holds.

- ``*_auth_read_ratio``: one tier's chunk reads followed by the store's verification, with a
  cluster secret (the MAC, GMAC, stands for the xxh3 payload checksum) against without (the
  checksum only), on the same objects, rounds interleaved; a ratio of throughputs
  (target >= 0.9).
- ``note_apply_lock_ms``: the longest hold of the store lock while another server's journal is
  applied — a hostile 20 MB note (refused from its size, before it is read) and a full note of
  ``journal.MAX_RECORDS`` valid records (applied in batches) — on a shared folder
  (target <= 2 ms).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvtier import codec
from kvtier.auth import Keyring
from kvtier.bench.report import Row
from kvtier.config import ServerConfig, TierConfig
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.store import TieredStore, journal
from kvtier.tiers import TIERS, LowerTier

NS = b"\x44" * 32
SECRET = b"kvtier bench cluster secret"


def auth_read(backend: str, tier: LowerTier, size: int, count: int = 16, rounds: int = 7
              ) -> tuple[list[Row], dict[str, float]]:
    """Read ``count`` chunks of ``size`` payload bytes and verify them, with and without
    the keyring, in interleaved rounds; medians."""
    keyring = Keyring.from_secrets([SECRET])
    stored = codec.stored_size(size)
    buf = mmap.mmap(-1, 2 * stored)
    view, into = memoryview(buf)[:stored], memoryview(buf)[stored:]
    np.frombuffer(buf, dtype=np.uint8)[codec.HEADER_SIZE:stored] = 7
    keys = chunk_keys(NS, np.arange(count * 16, dtype=np.int32) + size + 17, 16)
    try:
        for key in keys:
            codec.seal(view, NS, key, 16, size, keyring=keyring)
            tier.write(key, view)

        def reads(ring: Keyring | None) -> Callable[[], None]:
            def run() -> None:
                for key in keys:
                    n = tier.read_into(key, into, namespace=NS)
                    assert n is not None
                    codec.verify(into[:n], key, NS, ring)
            return run

        plain, signed = _interleaved(rounds, reads(None), reads(keyring))
        for key in keys:
            tier.delete(key, namespace=NS)
    finally:
        view.release()
        into.release()
        with contextlib.suppress(BufferError):
            buf.close()
    total = count * stored / 1e9
    label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
    rows = [Row(f"{backend} read+verify {label}, MAC GB/s", total / signed, total / plain,
                "checksum only")]
    return rows, {f"{backend}_auth_read_ratio": plain / signed,
                  f"{backend}_auth_read_gb_per_s": total / signed,
                  f"{backend}_plain_read_gb_per_s": total / plain}


def _interleaved(rounds: int, a: Callable[[], None], b: Callable[[], None]
                 ) -> tuple[float, float]:
    a()
    b()
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(rounds):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def tier_from(config: dict[str, Any]) -> LowerTier:
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    tier_config = TierConfig(**{"name": "bench", "capacity_bytes": 1 << 40, **cfg})
    return TIERS[tier_config.type].from_config(tier_config.name, tier_config)


# ---------------------------------------------------------------------- the journal

def note_apply_lock(root: Path | None = None) -> tuple[list[Row], dict[str, float]]:
    """Two stores share a folder; a hostile 20 MB note, then a full note of valid records,
    reach the reader; the longest lock hold applying each."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-note-")))
        reader = stack.enter_context(contextlib.closing(_store(root, "r")))
        reader.rebuild()
        tier = reader.tiers[0].tier
        assert hasattr(tier, "put_note")
        hostile = _held(reader, lambda: tier.put_note(
            journal.note_name(int(time.time() * 1000), "e" * 16, 0),
            os.urandom(20 << 20)), lambda: _rejected(reader, "note_too_large") >= 1)
        size = reader.tiers[0].fits_slot
        keys = [ChunkKey(i.to_bytes(32, "big")) for i in range(1, journal.MAX_RECORDS + 1)]
        records = msgspec.msgpack.encode([["+", NS, k, size] for k in keys])
        full = _held(reader, lambda: tier.put_note(
            journal.note_name(int(time.time() * 1000), "f" * 16, 0), records),
            lambda: keys[-1] in reader.tiers[0])
        reader.check_integrity()
    rows = [Row("lock hold applying a 20 MB note, ms", hostile[0] * 1e3, None,
                "refused by size"),
            Row(f"lock hold applying {len(keys)} records, ms", full[0] * 1e3, full[1] * 1e3,
                "CPU ms of that hold")]
    return rows, {"note_20mb_lock_ms": hostile[0] * 1e3, "note_full_lock_ms": full[0] * 1e3,
                  "note_full_lock_cpu_ms": full[1] * 1e3,
                  "note_apply_lock_ms": max(hostile[0], full[0]) * 1e3}


def _store(root: Path, name: str) -> TieredStore:
    slot = codec.stored_size(4096)
    config = ServerConfig.from_dict({
        "socket_path": str(root / f"{name}.sock"),
        "arena": {"size_bytes": 8 * slot, "slot_bytes": slot, "free_target": 0.0},
        "tiers": [{"type": "fs", "name": "shared", "capacity_bytes": 64 << 30,
                   "options": {"path": str(root / "volume"), "fsync": False,
                               "journal_interval_s": 0.05, "poll_s": 0.05,
                               "sweep_interval_s": 3600}}]})
    return TieredStore(config, arena_name=f"kvtier-bench-note-{os.getpid()}-{name}",
                       keyring=None)


def _held(store: TieredStore, put: Callable[[], None], done: Callable[[], bool]
          ) -> tuple[float, float]:
    """(longest wall-clock hold, longest CPU time in one hold) of the journal's lock."""
    store.lock_max_s.pop("journal", None)
    store.lock_cpu_max_s.pop("journal", None)
    put()
    deadline = time.monotonic() + 30
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError("the note was never applied")
        time.sleep(0.01)
    return store.lock_max_s.get("journal", 0.0), store.lock_cpu_max_s.get("journal", 0.0)


def _rejected(store: TieredStore, what: str) -> int:
    sharing = store.sharing.get(store.tiers[0].name)
    return 0 if sharing is None else sharing.rejected.get(what, 0)
