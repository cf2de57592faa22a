"""How long housekeeping holds the store lock with a million chunks indexed.

Every engine waits on the store lock, so housekeeping (expiry every half second, a client
disconnecting, I/O timeouts, breaker probes, space checks) must cost what changed, not what
is stored. The store below indexes 1M chunks on its disk tier (books only: no files are
written) and holds leases and reservations of many clients; then expiry, clients leaving and
coming back, and full housekeeping rounds run while the store records its longest lock hold
per operation. The figure is the CPU time of the holding thread (the store's own work; a busy
machine's preemption does not inflate it); the wall time is reported beside it. The baseline
is one pass over the 1M index under the lock: what any housekeeping that scans entries would
cost at least.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kvtier.bench.report import Row
from kvtier.codec import stored_size
from kvtier.config import ServerConfig
from kvtier.keys import ChunkKey
from kvtier.store import TieredStore

NS = b"\x22" * 32
HOUSEKEEPING_OPS = ("expire", "drop_owner", "resume_owner", "overdue", "breaker", "space")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bench(tmp: Path, chunks: int = 1_000_000, clients: int = 200) -> tuple[list[Row],
                                                                           dict[str, float]]:
    clock = _Clock()
    payload = 4096
    config = ServerConfig.from_dict({
        "socket_path": str(tmp / "hk.sock"),
        "arena": {"size_bytes": 2048 * stored_size(payload), "slot_bytes": stored_size(payload),
                  "free_target": 0.0, "prefault": False},
        "tiers": [{"type": "disk", "capacity_bytes": 2 * chunks * stored_size(payload),
                   "options": {"path": str(tmp / "hk-disk")}}],
        "lease_ttl_s": 30.0, "orphan_grace_s": 10.0})
    store = TieredStore(config, arena_name=f"kvtier-bench-hk-{time.time_ns()}", clock=clock)
    try:
        _index(store, chunks, payload)
        _hold(store, clients, payload)
        baseline = _scan(store)
        store.lock_max_s.clear()
        store.lock_cpu_max_s.clear()
        for round_ in range(20):
            clock.now += 1.0
            owner = 1 + round_ % clients
            store.drop_owner(owner)
            store.resume_owner(owner)
            if round_ % 5 == 0:
                store.drop_owner(clients + round_)
                clock.now += 11.0  # past the grace: that client's leases end
            store.housekeeping()
        held = max(store.lock_cpu_max_s.get(op, 0.0) for op in HOUSEKEEPING_OPS)
        wall = max(store.lock_max_s.get(op, 0.0) for op in HOUSEKEEPING_OPS)
        worst = max(HOUSEKEEPING_OPS, key=lambda op: store.lock_cpu_max_s.get(op, 0.0))
        store.check_integrity()
    finally:
        store.close(drain_s=0)
    rows = [Row(f"housekeeping lock hold ({worst}), {chunks // 1000}K chunks, ms",
                held * 1e3, baseline * 1e3, "one scan of the index"),
            Row("  ... in wall time, ms", wall * 1e3, None, "")]
    return rows, {"housekeeping_lock_ms_1m": held * 1e3, "housekeeping_lock_wall_ms_1m": wall * 1e3,
                  "index_scan_ms_1m": baseline * 1e3}


def _index(store: TieredStore, chunks: int, payload: int) -> None:
    raw = np.random.default_rng(7).bytes(32 * chunks)
    disk = store.tiers[0]
    size = stored_size(payload)

    def index_all() -> None:
        for i in range(chunks):
            disk.index(ChunkKey(raw[32 * i : 32 * i + 32]), size, 35, NS)

    store.apply("bench-index", index_all)


def _hold(store: TieredStore, clients: int, payload: int) -> None:
    """Each client holds a lease of a few arena chunks and a few reservations."""
    rng = np.random.default_rng(8)
    for owner in range(1, 2 * clients + 1):
        keys = [ChunkKey(rng.bytes(32)) for _ in range(4)]
        slots = store.reserve(owner, NS, keys[:2], payload_len=payload, tokens=16)
        store.commit([k for k, s in zip(keys[:2], slots, strict=True) if s is not None], owner)
        store.lease(owner, keys[:2])
        store.reserve(owner, NS, keys[2:], payload_len=payload, tokens=16)


def _scan(store: TieredStore) -> float:
    sizes = store.tiers[0].sizes
    store.lock_cpu_max_s.pop("bench-scan", None)
    store.apply("bench-scan", lambda: sum(1 for _ in sizes.values()))
    return store.lock_cpu_max_s["bench-scan"]
