"""A fake CUDA stream for the worker's store fencing, on CPU tensors.

``FakeStreamCopier`` wraps a real copier (the staged CUDA copier on a host lane) and defers
its work the way a stream does: a ``store``/``load`` call only queues the copy and returns an
event; the copy runs when the test lets the "GPU" catch up (``drain``), or when someone waits
on an event (the stream runs in order, so waiting for one copy runs every earlier one too).
So a store that nobody waits for really does read its blocks late: if vLLM's next forward
rewrote them first, the arena gets the wrong bytes, and a test can see it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.vllm.transfer import ChunkCopy


class FakeEvent:
    def __init__(self, stream: FakeStream, work: Callable[[], object]) -> None:
        self.stream = stream
        self.work = work
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.stream.run_until(self)

    def seconds(self) -> float:
        return 0.0


class FakeStream:
    def __init__(self) -> None:
        self.queue: deque[FakeEvent] = deque()
        self.events: list[FakeEvent] = []

    def enqueue(self, work: Callable[[], object]) -> FakeEvent:
        event = FakeEvent(self, work)
        self.queue.append(event)
        self.events.append(event)
        return event

    def run_until(self, event: FakeEvent) -> None:
        while not event.done and self.queue:
            head = self.queue.popleft()
            head.work()
            head.done = True

    def drain(self) -> None:
        while self.queue:
            self.run_until(self.queue[-1])


class FakeStreamCopier:
    """The copier interface the worker uses, with the wrapped copier's work deferred."""

    synchronous = False

    def __init__(self, inner: Any, stream: FakeStream) -> None:
        self.inner = inner
        self.stream = stream

    def attach(self, arena: np.ndarray) -> Any:
        return self.inner.attach(arena)

    def detach(self) -> None:
        self.stream.drain()
        self.inner.detach()

    def store(self, chunks: Sequence[ChunkCopy]) -> FakeEvent:
        return self.stream.enqueue(lambda: self.inner.store(chunks))

    def load(self, chunks: Sequence[ChunkCopy]) -> FakeEvent:
        return self.stream.enqueue(lambda: self.inner.load(chunks))

    def synchronize(self) -> None:
        self.stream.drain()
