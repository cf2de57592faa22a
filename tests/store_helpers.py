"""Tiny helpers that let store, server and client tests read as stories.

A chunk's payload is a recognisable pattern: the key's bytes repeated, shifted by the byte
index and a ``fill`` number, so a payload read from the wrong slot, a stale slot or a torn
file never equals the one expected.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from kvtier.client import KvtierClient
from kvtier.codec import HEADER_SIZE, stored_size
from kvtier.config import ServerConfig
from kvtier.keys import ChunkKey
from kvtier.metrics import StoreMetrics
from kvtier.server import NodeServer
from kvtier.store import TieredStore
from kvtier.store.iopool import IOPool
from kvtier.store.records import ItemState

NS = hashlib.sha256(b"kvtier tests").digest()
MakeStore = Callable[..., TieredStore]
"""The ``make_store`` fixture: ``make_store(tmp_path, slots=6, disk_bytes=None, ...)``."""
MakeServer = Callable[..., NodeServer]
"""The ``make_server`` fixture: ``make_server(slots=8, disk_bytes=None, **server_config)``."""
SLOT_BYTES = 8192
PAYLOAD = 1000
TOKENS = 16
CHUNK_BYTES = stored_size(PAYLOAD)
"""Bytes one test chunk occupies in a slot or a file (header page + one payload page)."""

T = TypeVar("T")
_arena_ids = itertools.count()


def arena_name() -> str:
    return f"kvtier-test-{os.getpid()}-{next(_arena_ids)}"


def keys(n: int, label: str = "k") -> list[ChunkKey]:
    return [ChunkKey(hashlib.sha256(f"{label}{i}".encode()).digest()) for i in range(n)]


def pattern(key: bytes, fill: int = 0, n: int = PAYLOAD) -> np.ndarray:
    base = np.resize(np.frombuffer(key, dtype=np.uint8), n).astype(np.uint32)
    return ((base + np.arange(n, dtype=np.uint32) + fill) % 256).astype(np.uint8)


def expected(chunk_keys: Sequence[bytes], fill: int = 0, n: int = PAYLOAD) -> list[bytes]:
    return [pattern(key, fill, n).tobytes() for key in chunk_keys]


# ---------------------------------------------------------------------- the store

def tier_config(root: Path, disk_bytes: int, write_policy: str = "through",
                admission: dict[str, int] | None = None, *, name: str = "disk",
                **options: Any) -> dict[str, Any]:
    """A disk tier called ``name`` in the folder of that name under ``root``."""
    return {"type": "disk", "name": name, "capacity_bytes": disk_bytes,
            "write_policy": write_policy, "admission": admission or "always",
            "options": {"path": str(root / name), **options}}


def build_store(root: Path, *, slots: int = 6, disk_bytes: int | None = None,
                write_policy: str = "through", admission: dict[str, int] | None = None,
                clock: Callable[[], float] | None = None, lease_ttl_s: float = 30.0,
                orphan_grace_s: float = 0.0,
                free_target: float = 0.0, io_threads: int = 2,
                disk_options: dict[str, Any] | None = None,
                tiers: list[dict[str, Any]] | None = None,
                retention_quotas: dict[str, Any] | None = None,
                slot_bytes: int = SLOT_BYTES) -> TieredStore:
    """A store with ``slots`` arena slots and, given ``disk_bytes``, a disk tier under root
    (or the lower ``tiers`` given)."""
    tiers = list(tiers or [])
    if disk_bytes is not None:
        tier = tier_config(root, disk_bytes, write_policy, admission, **(disk_options or {}))
        tiers.append({**tier, "io_threads": io_threads})
    config = ServerConfig.from_dict({
        "socket_path": str(root / "unused.sock"),
        "arena": {"size_bytes": slots * slot_bytes, "slot_bytes": slot_bytes,
                  "free_target": free_target},
        "tiers": tiers,
        "lease_ttl_s": lease_ttl_s,
        "orphan_grace_s": orphan_grace_s,
        "retention_quotas": retention_quotas,
    })
    if clock is None:
        return TieredStore(config, arena_name=arena_name())
    return TieredStore(config, arena_name=arena_name(), clock=clock)


def server_config(root: Path, *, slots: int = 8, disk_bytes: int | None = None,
                  **extra: Any) -> ServerConfig:
    tiers = [tier_config(root, disk_bytes)] if disk_bytes is not None else []
    return ServerConfig.from_dict({
        "socket_path": str(root / "kvtier.sock"),
        "arena": {"size_bytes": slots * SLOT_BYTES, "slot_bytes": SLOT_BYTES,
                  "free_target": 0.0},
        "tiers": tiers,
        **extra,
    })


def store_chunks(store: TieredStore, chunk_keys: Sequence[ChunkKey], fill: int = 0, *,
                 owner: int = 1, priority: int = 35, first_index: int = 0,
                 n: int = PAYLOAD, retain_s: float | None = None,
                 tenant: str | None = None) -> list[int | None]:
    """Reserve, write each granted slot's payload pattern, commit; returns the slots."""
    slots = store.reserve(owner, NS, chunk_keys, payload_len=n, tokens=TOKENS,
                          priority=priority, first_index=first_index, retain_s=retain_s,
                          tenant=tenant)
    granted = [key for key, slot in zip(chunk_keys, slots, strict=True) if slot is not None]
    for key, slot in zip(chunk_keys, slots, strict=True):
        if slot is not None:
            store.arena.array[slot, HEADER_SIZE : HEADER_SIZE + n] = pattern(key, fill, n)
    assert store.commit(granted) == len(granted)
    return slots


class Loaded(NamedTuple):
    tiers: list[str]
    """Where the lease found each chunk (``arena`` or the lower tier it was promoted from)."""
    payloads: list[bytes | None]
    """Each leased chunk's payload, ``None`` where loading it failed."""


def load(store: TieredStore, chunk_keys: Sequence[ChunkKey], *, owner: int = 1,
         n: int = PAYLOAD) -> Loaded:
    """Lease the longest available prefix, wait for promotions, read it back, release."""
    record = store.lease(owner, chunk_keys)
    store.wait(record.lease_id, 10.0)
    payloads = [
        store.arena.array[item.slot, HEADER_SIZE : HEADER_SIZE + n].tobytes()
        if item.state is ItemState.READY else None
        for item in record.items
    ]
    store.release(record.lease_id)
    return Loaded([item.tier for item in record.items], payloads)


class HasMetrics(Protocol):
    @property
    def metrics(self) -> StoreMetrics: ...


def sample(source: HasMetrics, name: str, **labels: str) -> float:
    """A metric's value in a store's or server's registry (0 before its first increment)."""
    value = source.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def settle(store: TieredStore) -> None:
    """Wait for writes and promotions, then for the deletes queued behind them: once every
    I/O thread of a tier meets at a barrier, every job submitted before has finished."""
    assert store.flush()
    for state in store.tiers:
        threads = state.config.io_threads
        barrier = threading.Barrier(threads + 1)
        for _ in range(threads):
            state.pool.submit(lambda _job, b=barrier: b.wait(10.0))
        barrier.wait(10.0)


def disk_files(root: Path) -> dict[str, Path]:
    """Chunk files of the disk tier under ``root``, by key hex."""
    return {p.name.removesuffix(".kvc"): p for p in (root / "disk" / "chunks").rglob("*.kvc")}


@contextmanager
def stalled(pool: IOPool, threads: int) -> Iterator[None]:
    """Keep every I/O thread of a tier busy until the block ends (jobs queue up behind)."""
    go = threading.Event()
    for _ in range(threads):
        pool.submit(lambda _job: go.wait(10.0))
    try:
        yield
    finally:
        go.set()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll a condition another thread or process makes true (a server noticing a hang-up)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ---------------------------------------------------------------------- through a client

def store_of(server: NodeServer) -> TieredStore:
    """The store inside an embedded server (to check its books after a story)."""
    assert server.store is not None
    return server.store


def client_store(client: KvtierClient, chunk_keys: Sequence[ChunkKey], fill: int = 0, *,
                 n: int = PAYLOAD) -> list[int | None]:
    """The two-phase store through the server: reserve, write into the arena, commit."""
    slots = client.reserve(NS, chunk_keys, payload_len=n, tokens=TOKENS)
    granted = [key for key, slot in zip(chunk_keys, slots, strict=True) if slot is not None]
    for key, slot in zip(chunk_keys, slots, strict=True):
        if slot is not None:
            client.payload_view(slot, n)[:] = pattern(key, fill, n)
    if granted:
        assert client.commit(granted) == len(granted)
    return slots


def client_load(client: KvtierClient, chunk_keys: Sequence[ChunkKey], *, n: int = PAYLOAD
                ) -> list[bytes | None]:
    lease = client.lease(chunk_keys)
    status = client.wait(lease.lease_id, 10.0)
    payloads = [client.payload_view(slot, n).tobytes() if ready else None
                for slot, ready in zip(lease.slots, status.ready, strict=True)]
    client.release(lease.lease_id)
    return payloads


# ---------------------------------------------------------------------- real filesystems

@contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``path`` (needs root, as in CI)."""
    if os.geteuid() != 0:
        import pytest

        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs",
                    str(path)], check=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


def remount(path: Path, mode: str) -> None:
    """Make a mounted tmpfs read-only (``ro``) or writable again (``rw``)."""
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True, timeout=30)


def peak_bytes(call: Callable[[], T]) -> tuple[T | BaseException, int]:
    """What ``call`` returned (or raised) and the most memory Python held meanwhile: a
    value read whole shows here, one refused before it is read does not."""
    tracemalloc.start()
    try:
        try:
            result: T | BaseException = call()
        except Exception as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
