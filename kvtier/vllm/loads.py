"""Load planning for the scheduler side: from a lease to the worker's copy job.

A load covers the chunks of a hit, minus the blocks vLLM already holds (its own prefix hit
is block aligned, chunks are larger)::

    chunk:   |   c0    |   c1    |   c2    |      (blocks_per_chunk = 2)
    block:   | b0 | b1 | b2 | b3 | b4 | b5 |
    local:   |=========|====|                    vLLM's own hit: 3 blocks
    load:                   | b3 | b4 | b5 |     only these are copied

Chunks are usable as a prefix: from the first chunk that is not ready (vanished, promotion
failed or late, server gone) on, every block is reported failed and vLLM recomputes it.
"""

from __future__ import annotations

from kvtier.protocol import LeaseReply, Wait
from kvtier.vllm.link import ServerLink
from kvtier.vllm.metadata import LoadJob
from kvtier.vllm.tracking import ChunkLoad, HitPlan, LoadState


def chunk_loads(plan: HitPlan, lease: LeaseReply | None, block_ids: list[int],
                block_size: int, blocks_per_chunk: int) -> list[ChunkLoad]:
    """The blocks to fill for each planned chunk, with the slot it was leased in."""
    first_block = plan.local_tokens // block_size
    leased = len(lease.slots) if lease is not None else 0
    out = []
    for i, planned_tier in enumerate(plan.tiers):
        index = plan.start_chunk + i
        blocks = [b for b in range(index * blocks_per_chunk, (index + 1) * blocks_per_chunk)
                  if first_block <= b < len(block_ids)]
        slot = lease.slots[i] if lease is not None and i < leased else None
        tier = lease.tiers[i] if lease is not None and i < leased else planned_tier
        out.append(ChunkLoad(index, slot, tier, [block_ids[b] for b in blocks],
                             [b - index * blocks_per_chunk for b in blocks]))
    return out


def readiness(load: LoadState, link: ServerLink, now: float) -> list[bool] | None:
    """Per chunk: servable now. ``None``: still being promoted, ask again later."""
    leased = [c.slot is not None for c in load.chunks]
    if load.lease_id is None or load.lease_ready:
        return leased
    status = link.call(Wait(load.lease_id, 0.0), None)
    if status is None:
        return [False] * len(leased)
    if not status.done and now < load.deadline:
        return None
    return [ok and i < len(status.ready) and status.ready[i] and not status.failed[i]
            for i, ok in enumerate(leased)]


def make_job(req_id: str, load: LoadState, ready: list[bool], block_size: int) -> LoadJob:
    """The worker's job for the usable prefix; records loaded and failed tokens and the
    chunks served in ``load``."""
    job = LoadJob(req_id, load.arena)
    usable = next((i for i, ok in enumerate(ready) if not ok), len(ready))
    for chunk in load.chunks[:usable]:
        assert chunk.slot is not None
        job.block_ids += chunk.block_ids
        job.slots += [chunk.slot] * len(chunk.block_ids)
        job.positions += chunk.positions
        tokens = len(chunk.block_ids) * block_size
        load.loaded[chunk.tier] = load.loaded.get(chunk.tier, 0) + tokens
        load.served.append(chunk.index)
    for chunk in load.chunks[usable:]:
        job.failed_block_ids += chunk.block_ids
        load.failed += len(chunk.block_ids) * block_size
    return job
