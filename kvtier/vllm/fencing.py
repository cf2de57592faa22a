"""Which pending stores must finish before vLLM overwrites the blocks they read.

On CUDA a store is copied after the step's forward on a side stream and finishes later.
vLLM frees a request's blocks as soon as it finishes (``request_finished`` returns False)
or is preempted, and may hand them to another request in the next step, whose forward,
zeroing (``new_block_ids_to_zero``) or block copies (``kv_cache_block_copies``) then write
them. vLLM's own offloading connector waits, in the worker's ``handle_preemptions`` (which
runs before all of those), only for the stores whose blocks are reallocated in that step
(``jobs_to_flush``); kvtier does the same:

- every store job is fenced on its block ids from the step that planned it until the
  scheduler side settles it (committed or aborted, :meth:`StoreFences.retain`);
- each step, the blocks the step hands out or overwrites (:class:`Reuse`, built by the
  connector from the scheduler output) are checked against the fences; the keys hit go to
  the workers in ``StepPlan.flush`` and their fences are dropped (once a worker has waited,
  nothing reads those blocks any more);
- a step that preempts any request flushes every pending store (correctness first).

Running requests keep their blocks, so fencing them from the start costs nothing and covers
finishes, aborts and preemptions alike. On vLLM's CPU build stores complete within the step,
so a flush finds nothing pending and costs nothing.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass

from kvtier.errors import IntegrityError
from kvtier.vllm.metadata import StoreJob


@dataclass(frozen=True)
class Reuse:
    """What a step does to blocks that might still be read by a store."""

    blocks: frozenset[int] = frozenset()
    """Block ids (re)allocated or written by vLLM this step."""
    preempted: bool = False
    """The step preempted a request (flush everything)."""


class StoreFences:
    """Block ids read by store jobs not yet settled, both ways round."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, tuple[int, ...]] = {}
        self._keys: dict[int, set[bytes]] = {}

    def add(self, jobs: Iterable[StoreJob]) -> None:
        for job in jobs:
            self._drop(job.key)
            self._blocks[job.key] = tuple(job.block_ids)
            for block in job.block_ids:
                self._keys.setdefault(block, set()).add(job.key)

    def flush(self, reuse: Reuse) -> list[bytes]:
        """Keys of the stores the workers must wait for before this step's forward."""
        if reuse.preempted:
            keys = list(self._blocks)
        else:
            hit: set[bytes] = set()
            for block in reuse.blocks:
                hit |= self._keys.get(block, set())
            keys = [key for key in self._blocks if key in hit]  # in planning order
        for key in keys:
            self._drop(key)
        return keys

    def retain(self, pending: Container[bytes]) -> None:
        """Drop the fences of stores no longer pending (committed or aborted)."""
        for key in [k for k in self._blocks if k not in pending]:
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        for block in self._blocks.pop(key, ()):
            keys = self._keys[block]
            keys.discard(key)
            if not keys:
                del self._keys[block]

    def __len__(self) -> int:
        return len(self._blocks)

    def check_integrity(self) -> None:
        """Both maps describe the same fences."""
        pairs = {(k, b) for k, blocks in self._blocks.items() for b in blocks}
        back = {(k, b) for b, keys in self._keys.items() for k in keys}
        if pairs != back:
            raise IntegrityError(f"store fences disagree: {len(pairs)} key->block pairs, "
                                 f"{len(back)} block->key pairs")
        if any(not keys for keys in self._keys.values()):
            raise IntegrityError("a block is fenced by no store")
