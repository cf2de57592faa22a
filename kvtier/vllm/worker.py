"""The worker side: run the step's copies and report what happened.

Each step the scheduler side sends a :class:`~kvtier.vllm.metadata.StepPlan`. Loads are
copied arena -> KV blocks in ``start_load_kv`` (the requests wait outside the batch until
reported); stores are copied KV blocks -> arena in ``wait_for_save``, after the forward that
computed them. Then the worker reports:

- finished loads (``finished_recving``), always, also for jobs that failed or were
  cancelled, because vLLM holds the request's blocks until it hears back;
- blocks that failed to load (vLLM recomputes from the first one);
- stored / failed chunk keys (the scheduler side commits or aborts them).

On CUDA copies finish asynchronously (:mod:`kvtier.vllm.cuda_copier`): they are reported
once their event completed, and before a forward the worker waits only for the stores the
plan names in ``flush`` (vLLM reuses their blocks in that step, :mod:`kvtier.vllm.fencing`).

A job whose arena is not the one this worker maps (the server restarted since the
scheduler leased or reserved) fails as a whole: the slot numbers would point into another
arena. Nothing here raises into vLLM; any error turns into failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from kvtier.codec import HEADER_SIZE
from kvtier.errors import ConfigError
from kvtier.vllm.counters import Counters
from kvtier.vllm.cuda_copier import CudaCopier
from kvtier.vllm.lanes import CudaLane, Lane
from kvtier.vllm.metadata import LoadJob, PayloadLayout, StoreJob, WorkerReport
from kvtier.vllm.pages import page_views
from kvtier.vllm.pinning import PinMode, default_pinner
from kvtier.vllm.transfer import ChunkCopy, CpuCopier

log = logging.getLogger("kvtier.vllm")


class ArenaLike(Protocol):
    array: np.ndarray


class HelloLike(Protocol):
    @property
    def arena_id(self) -> str: ...


class WorkerClient(Protocol):
    def connect(self, *, refresh: bool = False) -> HelloLike: ...
    @property
    def arena(self) -> ArenaLike: ...
    def close(self) -> None: ...


class WorkerSide:
    def __init__(self, layout: PayloadLayout, rank: int, num_blocks: int,
                 client: WorkerClient) -> None:
        self.layout = layout
        self.rank = rank
        self.num_blocks = num_blocks
        self.client = client
        self.copier: CpuCopier | CudaCopier | None = None
        self.counters = Counters()
        self._attached: object | None = None
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._report = WorkerReport()
        self._pending_loads: list[tuple[Any, LoadJob]] = []
        self._pending_stores: list[tuple[Any, list[bytes]]] = []

    def register(self, kv_caches: Mapping[str, torch.Tensor], lane: Lane | None = None
                 ) -> None:
        """Map the KV caches; ``lane``: run the staged (CUDA) copier there, whatever the
        device (tests use a fake lane on CPU tensors)."""
        try:
            pages = page_views(kv_caches, self.num_blocks, self.layout.page_bytes)
        except ConfigError as exc:
            log.error("kvtier disabled on this worker: %s", exc)
            return
        if len(pages) != self.layout.num_layers:
            log.error("kvtier disabled on this worker: %d distinct layer caches, expected %d",
                      len(pages), self.layout.num_layers)
            return
        try:
            self.copier = self._copier(pages, lane)
        except Exception:  # e.g. no memory left for the staging buffer: vLLM goes on
            log.exception("kvtier disabled on this worker: no copier")

    def _copier(self, pages: list[torch.Tensor], lane: Lane | None
                ) -> CpuCopier | CudaCopier:
        if lane is not None:
            return CudaCopier(pages, self.layout, self.rank, lane)
        device = pages[0].device
        if device.type == "cuda":
            copier = CudaCopier(pages, self.layout, self.rank, CudaLane(device),
                                default_pinner())
            log.info("kvtier worker %d: %d layer stack(s), %d run(s) per page, staging %d "
                     "bytes on %s", self.rank, len(copier.stacks), int(pages[0].shape[1]),
                     int(copier.staging.numel()), device)
            return copier
        return CpuCopier(pages, self.layout, self.rank)

    # ------------------------------------------------------------------ arena

    def _arena(self, name: str) -> np.ndarray | None:
        """The arena's ``[slots, slot_bytes]`` array if it is the one named ``name``."""
        if self.copier is None or not name:
            return None
        try:
            if self.client.connect().arena_id != name:
                # Our connection may predate a server restart (a worker only talks to the
                # server at handshake): let go of the old mapping (pinned memory first),
                # shake hands again, and give up on the job only if it still differs.
                self.copier.detach()
                self._attached = None
                if self.client.connect(refresh=True).arena_id != name:
                    return None
            arena = self.client.arena
            if arena is not self._attached:
                self._attached = None
                self._count_pinning(self.copier.attach(arena.array))
                self._attached = arena
            return arena.array
        except Exception as exc:  # server gone, mapping failed: the jobs fail, vLLM goes on
            log.warning("kvtier arena unavailable on worker %d: %s", self.rank, exc)
            return None

    def _count_pinning(self, mode: PinMode | None) -> None:
        if mode is PinMode.PINNED:
            self.counters.add("arena_pinned")
        elif mode is PinMode.PAGEABLE:
            self.counters.add("arena_pageable")

    def _payload(self, arena: np.ndarray, slot: int) -> np.ndarray:
        return arena[slot, HEADER_SIZE : HEADER_SIZE + self.layout.payload_len]

    # ------------------------------------------------------------------ loads

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        for job in jobs:
            self._failed_blocks.update(job.failed_block_ids)
            if not job.block_ids:
                self._finished_loads.add(job.req_id)
                continue
            try:
                self._start_load(job)
            except Exception:
                log.exception("kvtier load for %s failed; vLLM recomputes it", job.req_id)
                self._fail_load(job)

    def _start_load(self, job: LoadJob) -> None:
        arena = self._arena(job.arena)
        if arena is None or self.copier is None:
            self._fail_load(job)
            return
        chunks = self._group(arena, job)
        start = time.perf_counter()
        event = self.copier.load(chunks)
        if self.copier.synchronous:
            self._load_done(job, time.perf_counter() - start)
        else:
            self._pending_loads.append((event, job))

    def _group(self, arena: np.ndarray, job: LoadJob) -> list[ChunkCopy]:
        by_slot: dict[int, tuple[list[int], list[int]]] = {}
        for block, slot, pos in zip(job.block_ids, job.slots, job.positions, strict=True):
            blocks, positions = by_slot.setdefault(slot, ([], []))
            blocks.append(block)
            positions.append(pos)
        return [ChunkCopy(self._payload(arena, slot), blocks, positions)
                for slot, (blocks, positions) in by_slot.items()]

    def _load_done(self, job: LoadJob, seconds: float) -> None:
        self._finished_loads.add(job.req_id)
        pages = len(job.block_ids) * self.layout.num_layers
        self.counters.add("load_bytes", pages * self.layout.page_bytes)
        self.counters.add("load_seconds", seconds)

    def _fail_load(self, job: LoadJob) -> None:
        self._failed_blocks.update(job.block_ids)
        self._finished_loads.add(job.req_id)
        self._report.failed_loads.append(job.req_id)

    # ------------------------------------------------------------------ stores

    def save(self, jobs: Sequence[StoreJob]) -> None:
        by_arena: dict[str, list[StoreJob]] = {}
        for job in jobs:
            by_arena.setdefault(job.arena, []).append(job)
        for name, group in by_arena.items():
            keys = [job.key for job in group]
            try:
                self._save(name, group)
            except Exception:
                log.exception("kvtier store of %d chunks failed", len(group))
                self._report.failed += keys

    def _save(self, name: str, jobs: list[StoreJob]) -> None:
        arena = self._arena(name)
        keys = [job.key for job in jobs]
        if arena is None or self.copier is None:
            self._report.failed += keys
            return
        bpc = range(self.layout.blocks_per_chunk)
        chunks = [ChunkCopy(self._payload(arena, job.slot), job.block_ids, bpc) for job in jobs]
        start = time.perf_counter()
        event = self.copier.store(chunks)
        if self.copier.synchronous:
            self._stored(keys, time.perf_counter() - start)
        else:
            self._pending_stores.append((event, keys))

    def _stored(self, keys: list[bytes], seconds: float) -> None:
        self._report.stored += keys
        pages = len(keys) * self.layout.blocks_per_chunk * self.layout.num_layers
        self.counters.add("store_bytes", pages * self.layout.page_bytes)
        self.counters.add("store_seconds", seconds)

    def flush_stores(self, keys: Collection[bytes]) -> None:
        """Wait for the pending stores among ``keys``: vLLM is about to overwrite their
        blocks (called before the forward, in ``handle_preemptions``). A store copies one
        batch per step; waiting for one key waits for its batch."""
        if not keys or not self._pending_stores:
            return
        wanted = set(keys)
        still: list[tuple[Any, list[bytes]]] = []
        for event, batch in self._pending_stores:
            if wanted.isdisjoint(batch):
                still.append((event, batch))
                continue
            self.counters.add("flushed_stores")
            if _finished(event, wait=True):
                self._stored(batch, _seconds(event))
            else:
                self._report.failed += batch
        self._pending_stores = still

    # ------------------------------------------------------------------ reporting

    def _poll(self) -> None:
        still: list[tuple[Any, LoadJob]] = []
        for event, job in self._pending_loads:
            done = _finished(event)
            if done is None:
                self._fail_load(job)
            elif done:
                self._load_done(job, _seconds(event))
            else:
                still.append((event, job))
        self._pending_loads = still
        stores: list[tuple[Any, list[bytes]]] = []
        for event, keys in self._pending_stores:
            done = _finished(event)
            if done is None:
                self._report.failed += keys
            elif done:
                self._stored(keys, _seconds(event))
            else:
                stores.append((event, keys))
        self._pending_stores = stores

    def take_finished_loads(self) -> set[str]:
        self._poll()
        done, self._finished_loads = self._finished_loads, set()
        return done

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        return report or None

    def take_counters(self) -> dict[str, float]:
        return self.counters.take()

    def shutdown(self) -> None:
        if self.copier is not None:
            try:
                self.copier.synchronize()
                self.copier.detach()
            except Exception:
                log.exception("kvtier worker shutdown")
        self.client.close()


def _finished(event: Any, wait: bool = False) -> bool | None:
    """Whether a copy's event completed; ``None`` if the device reported an error (the copy
    counts as failed: vLLM recomputes, it is not handed an exception)."""
    try:
        if wait:
            event.synchronize()
            return True
        return bool(event.query())
    except Exception:
        log.exception("kvtier copy failed on the device")
        return None


def _seconds(event: Any) -> float:
    """Device time of a finished copy (0 if the event cannot tell)."""
    try:
        return float(event.seconds())
    except Exception:
        return 0.0
