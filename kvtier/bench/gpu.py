"""``kvtier bench gpu``: the connector's CUDA copy path on its own, with plain PyTorch.

No vLLM engine (and no vLLM install) is needed: for each KV cache layout vLLM can hand the
connector (:mod:`kvtier.bench.kvcaches`), a KV cache tensor on the GPU filled with random
bytes, a real arena (shared memory, registered as pinned memory by the copier), chunks stored
through :class:`~kvtier.vllm.cuda_copier.CudaCopier`, then loaded into other blocks. Printed,
and written as JSON with ``--json``:

- ``round_trip_equal``: the loaded pages equal the stored ones (and a partial load too);
- ``d2h_ratio`` / ``h2d_ratio``: the copier's throughput (wall time of a call until its
  event completed) over one plain pinned ``tensor.copy_(non_blocking=True)`` of the same
  bytes; target >= 0.8;
- ``memory``: GPU memory the copier allocated at peak (``torch.cuda.max_memory_allocated``
  over the KV cache), after one chunk and after all: bounded by the staging buffer;
- ``overlap``: whether a step's stores ran while a compute kernel queued after them on the
  default stream ran (CUDA events), as a fraction of the shorter of the two.

Without CUDA the round trips run on CPU tensors through the same copier (a host lane) and the
CUDA figures are skipped with a message; the exit status is then 0. Takes well under a
minute on one GPU with the defaults. Also runs as ``python -m kvtier.bench.gpu``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvtier.bench.kvcaches import LAYOUTS, KvShape, fill_random, kv_caches, shape_for
from kvtier.codec import HEADER_SIZE, align_up
from kvtier.tables import table
from kvtier.tiers.arena import Arena
from kvtier.vllm.cuda_copier import STAGING_CAP, CudaCopier
from kvtier.vllm.lanes import CudaEvent, CudaLane, HostLane, Lane
from kvtier.vllm.metadata import PayloadLayout
from kvtier.vllm.pages import page_views
from kvtier.vllm.pinning import HostPinner, default_pinner
from kvtier.vllm.transfer import ChunkCopy

TARGETS = {"d2h_ratio_min": 0.8, "h2d_ratio_min": 0.8, "overlap_fraction_min": 0.5}
MEMORY_SLACK = 1 << 20
"""Allowed copier memory beyond its staging buffer (block-id tensors, allocator rounding)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu", help="the CUDA copy path with plain PyTorch: round trips, "
                       "throughput vs copy_, memory, overlap (no vLLM needed)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma-separated (default: all: %(default)s)")
    p.add_argument("--layers", type=int, help="default: 32 on a GPU, 4 on CPU")
    p.add_argument("--chunks", type=int, help="chunks per call (default: 16 on a GPU, 4 on CPU)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed calls (the best counts)")
    p.add_argument("--staging-mib", type=float, help=f"staging cap (default "
                   f"{STAGING_CAP >> 20} MiB on a GPU; a third of a chunk on CPU, so that "
                   "calls need several fills)")
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a target is missed (a wrong round trip always does)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.gpu", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    figures: dict[str, Any] = {"cuda": cuda, "torch": torch.__version__}
    if not cuda:
        figures["skipped"] = _skip_message()
        print(f"kvtier bench gpu: {figures['skipped']}")
    bench = Bench(args, cuda)
    try:
        figures.update(bench.measure())
    finally:
        bench.close()
    figures["targets"] = TARGETS
    figures["targets_met"] = _targets_met(figures)
    _print(figures)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2) + "\n")
    equal = all(f["round_trip_equal"] for f in figures["layouts"].values())
    if not equal:
        return 1
    return 1 if args.check and cuda and not all(figures["targets_met"].values()) else 0


def _skip_message() -> str:
    why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device"
    return (f"CUDA is not available ({why}, torch {torch.__version__}): the layout round "
            "trips ran on CPU tensors through the same copier; throughput, GPU memory and "
            "overlap were skipped (still to be measured on a GPU)")


class Bench:
    def __init__(self, args: argparse.Namespace, cuda: bool) -> None:
        self.cuda = cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        self.layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
        unknown = sorted(set(self.layouts) - set(LAYOUTS))
        if unknown:
            raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
        self.chunks = args.chunks or (16 if cuda else 4)
        self.repeats = args.repeats
        blocks = args.chunk_tokens // 16
        self.base = KvShape(layers=args.layers or (32 if cuda else 4),
                            num_blocks=(2 * self.chunks + 1) * blocks + 1, block_size=16,
                            heads=8 if cuda else 2, head_dim=128 if cuda else 32)
        self.blocks = blocks
        self.staging_mib = args.staging_mib
        self.pinner: HostPinner | None = default_pinner() if cuda else None
        slot = HEADER_SIZE + align_up(max(self._layout(n).payload_len for n in self.layouts))
        self.arena = Arena(f"kvtier-gpucheck-{os.getpid()}", self.chunks, slot)
        self._refs: dict[int, dict[str, float]] = {}
        self._overlap_for = "LBNHC" if "LBNHC" in self.layouts else self.layouts[0]

    def _shape(self, name: str) -> KvShape:
        shape = shape_for(name, self.base)
        return KvShape(shape.layers, shape.num_blocks, shape.block_size, shape.heads,
                       576 if shape.mla and self.cuda else shape.head_dim, shape.dtype,
                       mla=shape.mla)

    def _layout(self, name: str) -> PayloadLayout:
        shape = self._shape(name)
        return PayloadLayout(shape.layers, 1, self.blocks, shape.page_bytes)

    def _staging_cap(self, layout: PayloadLayout) -> int:
        if self.staging_mib is not None:
            return int(self.staging_mib * (1 << 20))
        return STAGING_CAP if self.cuda else layout.payload_len // 3

    def close(self) -> None:
        self.arena.close()
        self.arena.unlink()

    # -------------------------------------------------------------- one layout

    def measure(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layouts": {}}
        if self.cuda:
            out["device"] = torch.cuda.get_device_name(self.device)
            out["pinner"] = self.pinner.name if self.pinner else None
        for name in self.layouts:
            try:
                figures, extra = self._one(name)
            except Exception as exc:  # one run on a lent GPU: report it, go on with the rest
                figures, extra = {"round_trip_equal": False, "error": repr(exc)}, {}
                print(f"kvtier bench gpu: layout {name} failed: {exc!r}", file=sys.stderr)
            out["layouts"][name] = figures
            out.update(extra)
        return out

    def _one(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        shape, layout = self._shape(name), self._layout(name)
        device = self.device or torch.device("cpu")
        caches = kv_caches(name, shape, device)
        fill_random(caches, seed=len(name))
        pages = page_views(caches, shape.num_blocks, shape.page_bytes)
        first = next(iter(caches.values()))
        lane: Lane = CudaLane(device) if self.cuda else HostLane()
        base = self._memory_base()
        copier = CudaCopier(pages, layout, 0, lane, self.pinner, self._staging_cap(layout))
        mode = copier.attach(self.arena.array)
        ids = torch.randperm(shape.num_blocks - 1, generator=torch.Generator().manual_seed(1))
        src, dst = (ids[: self.chunks * self.blocks] + 1).tolist(), \
            (ids[self.chunks * self.blocks : 2 * self.chunks * self.blocks] + 1).tolist()
        store, load = self._chunks(layout, src), self._chunks(layout, dst)
        extra: dict[str, Any] = {}
        try:
            figures = self._round_trip(copier, pages, store, load, src, dst)
            figures.update(shape=list(first.shape), strides=list(first.stride()),
                           stacks=len(copier.stacks), runs_per_page=int(pages[0].shape[1]),
                           page_bytes=shape.page_bytes, word=str(copier.stacks[0].view.dtype),
                           staging_bytes=int(copier.staging.numel()),
                           pin_mode=mode.value if mode else None)
            if self.cuda:
                figures["memory"] = self._peak(base, copier, store[:1], store, load)
                figures.update(self._throughput(copier, store, load, layout))
                if name == self._overlap_for:
                    extra["overlap"] = self._overlap(copier, store)
        finally:
            copier.detach()
        return figures, extra

    def _chunks(self, layout: PayloadLayout, ids: list[int]) -> list[ChunkCopy]:
        b = self.blocks
        return [ChunkCopy(self.arena.array[i, HEADER_SIZE : HEADER_SIZE + layout.payload_len],
                          ids[i * b : (i + 1) * b], range(b)) for i in range(self.chunks)]

    def _round_trip(self, copier: CudaCopier, pages: list[torch.Tensor],
                    store: list[ChunkCopy], load: list[ChunkCopy], src: list[int],
                    dst: list[int]) -> dict[str, Any]:
        copier.store(store).synchronize()
        copier.load(load).synchronize()
        equal = all(torch.equal(p[src], p[dst]) for p in pages)
        half = self.blocks // 2  # a partial load: the second half of chunk 0, elsewhere
        spare = sorted(set(range(1, pages[0].shape[0])) - set(src) - set(dst))[:half]
        first = store[0]
        copier.load([ChunkCopy(first.payload, spare, range(half, self.blocks))]).synchronize()
        partial = all(torch.equal(p[spare], p[src[half : self.blocks]]) for p in pages)
        return {"round_trip_equal": bool(equal and partial), "full_equal": bool(equal),
                "partial_equal": bool(partial)}

    # -------------------------------------------------------------- CUDA figures

    def _memory_base(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return int(torch.cuda.memory_allocated())

    def _peak(self, base: int, copier: CudaCopier, one: list[ChunkCopy],
              store: list[ChunkCopy], load: list[ChunkCopy]) -> dict[str, Any]:
        """The copier's peak allocations over ``base`` (before it existed): from now (the
        round-trip checks' own tensors are gone), after a one-chunk store, then after
        storing and loading all chunks."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        copier.store(one).synchronize()
        after_one = int(torch.cuda.max_memory_allocated()) - base
        copier.store(store).synchronize()
        copier.load(load).synchronize()
        after_all = int(torch.cuda.max_memory_allocated()) - base
        staging = int(copier.staging.numel())
        return {"staging_bytes": staging, "peak_after_one_chunk": after_one,
                "peak_after_all_chunks": after_all,
                "bounded": after_all <= staging + MEMORY_SLACK
                and after_all - after_one <= MEMORY_SLACK}

    def _throughput(self, copier: CudaCopier, store: list[ChunkCopy], load: list[ChunkCopy],
                    layout: PayloadLayout) -> dict[str, Any]:
        nbytes = len(store) * layout.payload_len
        ref = self._reference(nbytes)
        d2h, d2h_issue = self._best(lambda: copier.store(store))
        h2d, h2d_issue = self._best(lambda: copier.load(load))
        return {"bytes_per_call": nbytes,
                "d2h_GBps": round(nbytes / d2h / 1e9, 2),
                "h2d_GBps": round(nbytes / h2d / 1e9, 2),
                "ref_d2h_GBps": round(nbytes / ref["d2h"] / 1e9, 2),
                "ref_h2d_GBps": round(nbytes / ref["h2d"] / 1e9, 2),
                "d2h_ratio": round(ref["d2h"] / d2h, 3), "h2d_ratio": round(ref["h2d"] / h2d, 3),
                "store_issue_ms": round(d2h_issue * 1e3, 3),
                "load_issue_ms": round(h2d_issue * 1e3, 3)}

    def _best(self, call: Callable[[], Any]) -> tuple[float, float]:
        """Best wall time of ``call`` until its event completed, and of issuing it."""
        best, issue = math.inf, math.inf
        for _ in range(self.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            event = call()
            t1 = time.perf_counter()
            event.synchronize()
            best, issue = min(best, time.perf_counter() - t0), min(issue, t1 - t0)
        return best, issue

    def _reference(self, nbytes: int) -> dict[str, float]:
        """One plain pinned ``copy_(non_blocking=True)`` of ``nbytes`` each way."""
        if nbytes not in self._refs:
            gpu = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            host.fill_(1)
            d2h, _ = self._best(lambda: _Synced(host.copy_(gpu, non_blocking=True)))
            h2d, _ = self._best(lambda: _Synced(gpu.copy_(host, non_blocking=True)))
            self._refs[nbytes] = {"d2h": d2h, "h2d": h2d}
            del gpu, host
        return self._refs[nbytes]

    def _overlap(self, copier: CudaCopier, store: list[ChunkCopy]) -> dict[str, Any]:
        """A "forward", then the step's stores, then the next step's "forward" (matmuls on
        the default stream): did the stores run during the second one?"""
        a = torch.randn(4096, 4096, device=self.device, dtype=torch.bfloat16)
        c = torch.empty_like(a)

        def compute(n: int) -> None:
            for _ in range(n):
                torch.mm(a, a, out=c)

        event = copier.store(store)
        event.synchronize()
        store_s = event.seconds()
        per_mm = _timed(lambda: compute(10)) / 10
        n = max(1, math.ceil(store_s / per_mm))
        compute_s = _timed(lambda: compute(n))
        torch.cuda.synchronize()
        compute(max(8, n // 2))  # the step's forward, which the stores wait for
        forward_end = torch.cuda.Event(enable_timing=True)
        forward_end.record()
        stores = copier.store(store)
        assert isinstance(stores, CudaEvent)
        compute(n)  # the next step's forward
        compute_end = torch.cuda.Event(enable_timing=True)
        compute_end.record()
        torch.cuda.synchronize()
        span = max(forward_end.elapsed_time(stores.end),
                   forward_end.elapsed_time(compute_end)) / 1000
        fraction = (store_s + compute_s - span) / min(store_s, compute_s)
        return {"store_s": round(store_s, 5), "compute_s": round(compute_s, 5),
                "together_s": round(span, 5), "overlap_fraction": round(fraction, 3),
                "overlapped": fraction >= TARGETS["overlap_fraction_min"]}


class _Synced:
    """Stands for the event of a plain copy: waiting for it is synchronizing the device."""

    def __init__(self, _copied: torch.Tensor) -> None:
        return

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1000


def _targets_met(figures: dict[str, Any]) -> dict[str, bool]:
    layouts = figures["layouts"].values()
    met = {"round_trip_equal": all(f["round_trip_equal"] for f in layouts)}
    if figures["cuda"]:
        met["d2h_ratio"] = all(f["d2h_ratio"] >= TARGETS["d2h_ratio_min"] for f in layouts)
        met["h2d_ratio"] = all(f["h2d_ratio"] >= TARGETS["h2d_ratio_min"] for f in layouts)
        met["memory_bounded"] = all(f["memory"]["bounded"] for f in layouts)
        met["overlap"] = bool(figures.get("overlap", {}).get("overlapped"))
    return met


def _print(figures: dict[str, Any]) -> None:
    cols = ["round_trip_equal", "runs_per_page", "stacks", "word", "pin_mode"]
    if figures["cuda"]:
        cols += ["d2h_GBps", "ref_d2h_GBps", "d2h_ratio", "h2d_GBps", "ref_h2d_GBps",
                 "h2d_ratio", "store_issue_ms"]
        print(f"device: {figures['device']}, pinner: {figures['pinner']}")
    print(table(["layout", *cols], [[name, *(str(f.get(c)) for c in cols)]
                                    for name, f in figures["layouts"].items()]))
    if figures["cuda"]:
        for name, f in figures["layouts"].items():
            print(f"memory {name}: {f['memory']}")
        print(f"overlap: {figures.get('overlap')}")
    print(f"targets met: {figures['targets_met']}")


if __name__ == "__main__":
    sys.exit(main())
