"""Where the staged copier's work runs: a CUDA side stream, or the host for CPU tensors.

:class:`CudaLane` is the production path. Its semantics, from the CUDA and torch docs:

- ``begin()``: the side stream first waits for everything already queued on the current
  stream (``wait_stream``: the step's forward for a store; zeroing and earlier writes for a
  load), then work issued inside the block runs on the side stream, in order.
- Memory the copier allocates inside ``begin()``/``use()`` belongs to the side stream (the
  caching allocator reuses a block only for later work of the stream it was allocated on),
  so no ``record_stream`` is needed for tensors used only there; the KV cache (vLLM's, alive
  for the engine's life) and the arena (pinned by the copier) are never freed under a copy.
- ``index()``: block ids go to the device through a pinned host tensor and a
  ``non_blocking`` copy on the side stream: the host never waits, and torch's pinned-memory
  allocator keeps the host buffer until that copy has completed.
- ``finish()`` records a timing event after the work; the worker reports a copy done only
  once ``query()`` says so, and the event's elapsed time is the copy's device time.

:class:`HostLane` runs the same code on CPU tensors, synchronously (tests, ``kvtier bench
gpu`` without a GPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch


class CopyEvent(Protocol):
    def query(self) -> bool:
        """True once the copy finished (raises if the device reported an error)."""

    def synchronize(self) -> None:
        """Block until the copy finished."""

    def seconds(self) -> float:
        """Device time of the copy; only once it finished."""


class Lane(Protocol):
    device: torch.device

    def begin(self) -> Any:
        """Context: after the work queued so far on the current stream, run on the lane."""

    def use(self) -> Any:
        """Context: run on the lane (allocations belong to it), without waiting."""

    def start(self) -> Any:
        """A marker before the work of one call."""

    def finish(self, start: Any) -> CopyEvent:
        """The event of the work issued since ``start``."""

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the lane's device, without blocking the host."""

    def synchronize(self) -> None:
        """Block until all work on the lane finished."""


class CudaEvent:
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start, self.end = start, end

    def query(self) -> bool:
        return bool(self.end.query())

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


class CudaLane:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @contextmanager
    def begin(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def use(self) -> Any:
        return torch.cuda.stream(self.stream)

    def start(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def finish(self, start: torch.cuda.Event) -> CudaEvent:
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        return CudaEvent(start, end)

    def index(self, values: Sequence[int]) -> torch.Tensor:
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)

    def synchronize(self) -> None:
        self.stream.synchronize()


class DoneEvent:
    """A copy that finished when its call returned."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return

    def seconds(self) -> float:
        return self._seconds


class HostLane:
    """Synchronous execution on CPU tensors."""

    device = torch.device("cpu")

    @contextmanager
    def begin(self) -> Iterator[None]:
        yield

    def use(self) -> Any:
        return self.begin()

    def start(self) -> float:
        return time.perf_counter()

    def finish(self, start: float) -> CopyEvent:
        return DoneEvent(time.perf_counter() - start)

    def index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int64)

    def synchronize(self) -> None:
        return
