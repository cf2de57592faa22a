"""What a peer flooding the journal costs a lookup: its wait, with and without the flood.

A store shares a folder (an ``fs`` tier); a process of its own (the peer: no kvtier server,
only the tier's client) writes journal notes at the caps — ``journal.MAX_RECORDS`` puts of a
plausible size, fresh random keys, a new writer id every few notes — as fast as it can, while
a thread here looks up a 128K-token prompt (512 keys held in the arena) every millisecond and
times each call. Quiet and flooded phases alternate (``repeats`` of each, interleaved); each
phase reports the lookups' p50 and longest wait (a row per flooded phase, against the quiet
phase before it), and the flooded ones the records the reader took in (applied or refused
past the bounds of bookings) and, in the CPU time of the thread doing it, the longest hold of
the store lock applying them and the longest garbage collection: the work done in one go,
which no thread of the process can interrupt, and which a busy machine does not inflate.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvtier import codec
from kvtier.bench.report import Row
from kvtier.config import ServerConfig, TierConfig
from kvtier.keys import ChunkKey, chunk_keys
from kvtier.store import TieredStore, journal
from kvtier.tiers import TIERS

NS = b"\x55" * 32
PAYLOAD = 4096
LOOKUP_KEYS = 512


def bench(root: Path | None = None, repeats: int = 3, phase_s: float = 3.0
          ) -> tuple[list[Row], dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-flood-")))
        root.mkdir(parents=True, exist_ok=True)
        store = stack.enter_context(contextlib.closing(_store(root)))
        store.rebuild()
        keys = _held(store)
        quiet: list[tuple[float, float]] = []
        flood: list[tuple[float, float]] = []
        taken: list[int] = []
        work: list[tuple[float, float]] = []
        for i in range(repeats):
            quiet.append(_waits(store, keys, phase_s))
            before = _taken(store)
            with _Pauses(store) as pauses:
                flood.append(_flooded(store, keys, root / "volume", phase_s, i))
            work.append(pauses.longest)
            taken.append(_taken(store) - before)
        store.check_integrity()
    rows, figs = _report(quiet, flood, taken)
    figs["flood_journal_hold_cpu_max_ms_each"] = [round(w[0] * 1e3, 3) for w in work]
    figs["flood_gc_cpu_max_ms_each"] = [round(w[1] * 1e3, 3) for w in work]
    for i, (hold, collection) in enumerate(work):
        rows += [Row(f"  flooded phase {i + 1}, longest journal hold, CPU ms",
                     round(hold * 1e3, 3), None, ""),
                 Row(f"  flooded phase {i + 1}, longest garbage collection, CPU ms",
                     round(collection * 1e3, 3), None, "")]
    return rows, figs


class _Pauses:
    """What a flooded phase made this process do in one go, in the CPU time of the thread
    doing it (what a busy machine's preemption does not inflate): the longest hold of the
    store lock applying the journal, and the longest garbage collection."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.longest = (0.0, 0.0)
        self._gc_max = 0.0
        self._gc_start = 0.0

    def _collect(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.thread_time()
        else:
            self._gc_max = max(self._gc_max, time.thread_time() - self._gc_start)

    def __enter__(self) -> _Pauses:
        gc.collect()  # the phase's own collections only, from here
        self.store.lock_cpu_max_s.pop("journal", None)
        gc.callbacks.append(self._collect)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._collect)
        self.longest = (self.store.lock_cpu_max_s.get("journal", 0.0), self._gc_max)


def _store(root: Path) -> TieredStore:
    slot = codec.stored_size(PAYLOAD)
    config = ServerConfig.from_dict({
        "socket_path": str(root / "reader.sock"),
        "arena": {"size_bytes": (LOOKUP_KEYS + 8) * slot, "slot_bytes": slot,
                  "free_target": 0.0},
        "tiers": [_tier(root)]})
    return TieredStore(config, arena_name=f"kvtier-bench-flood-{os.getpid()}", keyring=None)


def _tier(root: Path) -> dict[str, Any]:
    return {"type": "fs", "name": "shared", "capacity_bytes": 1 << 30,
            "options": {"path": str(root / "volume"), "fsync": False,
                        "journal_interval_s": 0.05, "poll_s": 0.05, "sweep_interval_s": 3600}}


def _held(store: TieredStore) -> list[ChunkKey]:
    """A 128K-token prompt's keys, every chunk committed to the arena (and written through
    to the folder before the phases begin): the lookup is the arena's, the lock its only
    wait."""
    keys = chunk_keys(NS, np.arange(LOOKUP_KEYS * 256, dtype=np.int32), 256)
    slots = store.reserve(1, NS, keys, payload_len=PAYLOAD, tokens=256)
    assert all(slot is not None for slot in slots)
    store.commit(keys)
    assert store.flush()
    return keys


def _taken(store: TieredStore) -> int:
    """Peers' records in the books or refused past their bounds so far."""
    state = store.tiers[0]
    bookings = getattr(state, "bookings", None)  # none before bookings: every record is held
    if bookings is None:
        return len(state.sizes)
    return bookings.count + sum(bookings.refused.values())


def _waits(store: TieredStore, keys: list[ChunkKey], seconds: float, collect: bool = True
           ) -> tuple[float, float]:
    """(p50, longest) wall time of a lookup, one each millisecond for ``seconds`` (after a
    full collection unless ``collect`` is false: what this process left behind so far is
    not the phase's garbage)."""
    if collect:
        gc.collect()
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        store.lookup(keys)
        times.append(time.perf_counter() - start)
        time.sleep(0.001)
    return statistics.median(times), max(times)


def _flooded(store: TieredStore, keys: list[ChunkKey], volume: Path, seconds: float,
             run: int) -> tuple[float, float]:
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    peer = ctx.Process(target=flood, args=(str(volume), store.tiers[0].fits_slot, run, stop),
                       daemon=True)
    peer.start()
    try:
        time.sleep(0.5)  # the peer's interpreter starts, its first notes land
        return _waits(store, keys, seconds, collect=False)  # collected before it began
    finally:
        stop.set()
        peer.join(10)
        if peer.is_alive():
            peer.kill()


def flood(volume: str, size: int, run: int, stop: Any) -> None:
    """The peer (a process of its own): notes at the caps until ``stop`` is set."""
    config = TierConfig(name="shared", type="fs", capacity_bytes=1 << 30,
                        options={"path": volume, "fsync": False})
    tier: Any = TIERS["fs"].from_config("shared", config)
    rng = np.random.default_rng(run)
    seq = 0
    while not stop.is_set():
        raw = rng.bytes(32 * journal.MAX_RECORDS)
        records = [["+", NS, raw[i:i + 32], size] for i in range(0, len(raw), 32)]
        server = f"{run:04x}{seq // 8:012x}"  # a new writer id every 8 notes
        tier.put_note(journal.note_name(int(time.time() * 1000), server, seq),
                      msgspec.msgpack.encode(records))
        seq += 1


def _report(quiet: list[tuple[float, float]], flood: list[tuple[float, float]],
            taken: list[int]) -> tuple[list[Row], dict[str, Any]]:
    def ms(pairs: list[tuple[float, float]], i: int) -> list[float]:
        return [round(p[i] * 1e3, 3) for p in pairs]

    figs: dict[str, Any] = {
        "flood_lookup_p50_ms": statistics.median(ms(flood, 0)),
        "flood_lookup_max_ms": max(ms(flood, 1)),
        "quiet_lookup_p50_ms": statistics.median(ms(quiet, 0)),
        "quiet_lookup_max_ms": max(ms(quiet, 1)),
        "flood_records_per_phase": taken,
        "flood_lookup_p50_ms_each": ms(flood, 0), "flood_lookup_max_ms_each": ms(flood, 1),
        "quiet_lookup_p50_ms_each": ms(quiet, 0), "quiet_lookup_max_ms_each": ms(quiet, 1)}
    rows = [Row("lookup 512 keys under a journal flood, p50 ms", figs["flood_lookup_p50_ms"],
                figs["quiet_lookup_p50_ms"], "no flood"),
            Row("lookup 512 keys under a journal flood, max ms", figs["flood_lookup_max_ms"],
                figs["quiet_lookup_max_ms"], "no flood")]
    for i, records in enumerate(taken):  # each flooded phase against the quiet one before it
        phase = f"  flooded phase {i + 1} ({records} records)"
        rows += [Row(f"{phase}, p50 ms", figs["flood_lookup_p50_ms_each"][i],
                     figs["quiet_lookup_p50_ms_each"][i], f"quiet phase {i + 1}"),
                 Row(f"{phase}, max ms", figs["flood_lookup_max_ms_each"][i],
                     figs["quiet_lookup_max_ms_each"][i], f"quiet phase {i + 1}")]
    return rows, figs


if __name__ == "__main__":  # a quick look: python -m kvtier.bench.flood
    out_rows, out_figs = bench()
    for row in out_rows:
        print(row)
    print(out_figs)
