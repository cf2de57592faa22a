"""Pinning the arena for DMA, and the pageable fallback when it cannot be pinned."""

from __future__ import annotations

from typing import Any

from copier_helpers import SRC, arena, chunks, payload, setup
from rig import PAGE, FakeEngine

from kvtier.tiers.arena import Arena
from kvtier.vllm.cuda_copier import CudaCopier
from kvtier.vllm.lanes import HostLane
from kvtier.vllm.pinning import CudartPinner, PinMode, VllmPinner, default_pinner, loaded_library

__all__ = ["arena"]  # a fixture


class CountingPinner:
    name = "counting"

    def __init__(self, ok: bool) -> None:
        self.ok = ok
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def register(self, ptr: int, nbytes: int) -> bool:
        self.registered.append((ptr, nbytes))
        return self.ok

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def test_attach_pins_the_mapping_and_detach_unpins_it(arena: Arena) -> None:
    pages, lay = setup("LBNHC")
    pinner = CountingPinner(ok=True)
    copier = CudaCopier(pages, lay, 0, HostLane(), pinner)
    assert copier.attach(arena.array) is PinMode.PINNED
    assert pinner.registered == [(arena.array.ctypes.data, arena.array.nbytes)]
    assert copier.attach(arena.array) is PinMode.PINNED  # a new mapping: the old span goes
    assert pinner.unregistered == [arena.array.ctypes.data]
    copier.detach()
    copier.detach()
    assert len(pinner.unregistered) == 2


def test_a_mapping_that_cannot_be_pinned_stays_pageable(arena: Arena) -> None:
    pages, lay = setup("LBNHC")
    pinner = CountingPinner(ok=False)
    copier = CudaCopier(pages, lay, 0, HostLane(), pinner)
    assert copier.attach(arena.array) is PinMode.PAGEABLE
    copier.store(chunks(arena, lay, 0, SRC)).synchronize()  # copies still work
    assert payload(arena, 0, lay).any()
    copier.detach()
    assert pinner.unregistered == []


def test_the_worker_pins_once_per_mapping_and_counts_the_mode(make_server: Any) -> None:
    server = make_server(slots=32)
    engine = FakeEngine(server.socket_path, lane=HostLane)
    try:
        worker = engine.workers[0]
        pinner = CountingPinner(ok=False)
        assert isinstance(worker.copier, CudaCopier)
        worker.copier.pinner = pinner
        for start in (0, 1000):  # two prompts, several store steps
            req = engine.add(list(range(start, start + 100)))
            engine.run(req)
            engine.finish(req)
        assert len(pinner.registered) == 1  # a failure is not retried every step
        counters = worker.take_counters()
        assert counters["arena_pageable"] == 1 and "arena_pinned" not in counters
        assert counters["store_bytes"] == 6 * 2 * 2 * PAGE  # 6 chunks of 2 blocks, 2 layers
    finally:
        engine.close()


def test_without_cuda_nothing_is_pinned_and_nothing_raises() -> None:
    pinner = default_pinner()
    assert isinstance(pinner, VllmPinner)  # vLLM is installed here: its helper is used
    buf = bytearray(1 << 16)
    import ctypes

    ptr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    assert pinner.register(ptr, len(buf)) is False  # CPU platform: stays pageable
    assert CudartPinner().register(ptr, len(buf)) is False  # no CUDA runtime loaded


def test_loaded_libraries_are_found_by_name() -> None:
    libc = loaded_library("libc")
    assert libc is not None and "libc" in libc
    assert loaded_library("libcudart") is None  # a CPU-only torch loads no CUDA runtime
    assert loaded_library("libkvtier-nothing") is None
