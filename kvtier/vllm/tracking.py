"""Per-request bookkeeping of the scheduler side (plain data, no I/O).

A request's life as the scheduler side sees it::

    tracked ──lookup──► planned (HitPlan) ──alloc, lease──► loading (LoadState)
       ▲                    │ (re-planned on every call)          │ worker reports done
       │                    └──alloc without hit──► running ◄─────┘
       └── preempted: planned again, with what was stored meanwhile
    running: each step, newly computed full prompt chunks are reserved and copied (stores),
             and chunks of generated tokens where the request keeps them
    finished: accounting returned in kv_transfer_params; state dropped once no load is in flight
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.keys import ChunkKey
from kvtier.vllm.config import RequestOptions


@dataclass(frozen=True)
class RequestInfo:
    """What the scheduler side needs to know about a request, taken once from vLLM's."""

    req_id: str
    tokens: tuple[int, ...]
    """Prompt token ids (empty: the request is not cacheable, e.g. prompt embeddings)."""
    extras: tuple[str, ...]
    """Everything besides tokens that changes the KV: cache salt (tenant), LoRA adapter."""
    options: RequestOptions = field(default_factory=RequestOptions)


@dataclass
class HitPlan:
    """The answer of the last lookup for a request (not leased yet)."""

    local_tokens: int
    start_chunk: int
    tiers: list[str]
    skipped: dict[str, int] = field(default_factory=dict)
    """Tokens of the hit not worth loading (slower than recompute), by tier."""

    def hit_tokens(self, chunk_tokens: int) -> int:
        return (self.start_chunk + len(self.tiers)) * chunk_tokens - self.local_tokens


@dataclass
class ChunkLoad:
    index: int
    slot: int | None
    """None: not leased (vanished since the lookup, or the server is down)."""
    tier: str
    block_ids: list[int]
    positions: list[int]


@dataclass
class LoadState:
    lease_id: int | None
    arena: str
    chunks: list[ChunkLoad]
    lease_ready: bool
    deadline: float
    hold_until: float
    account: bool = True
    """Count this load in the request's accounting (its first admission only)."""
    emitted: bool = False
    cancelled: bool = False
    loaded: dict[str, int] = field(default_factory=dict)
    """Tokens handed to the worker to load, by tier."""
    failed: int = 0
    """Tokens that could not be served (their blocks are reported failed)."""
    served: list[int] = field(default_factory=list)
    """Indices of the chunks handed to the worker to load."""


@dataclass
class Accounting:
    """Where a request's prompt tokens came from at its first admission."""

    prompt_tokens: int
    device: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    failed_load: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Hit tokens recomputed because loading them was slower, by tier."""
    stored_chunks: int = 0
    """Chunks reserved for this request and handed to the workers to write (commits come
    too late: vLLM returns a request's kv_transfer_params before its last step's output)."""
    device_from_schedule: bool = False
    """The device hit is read from the first scheduled step (it may include a partial block
    that vLLM hides from the connector)."""

    def loaded(self) -> int:
        return sum(self.by_tier.values())

    def as_params(self) -> dict[str, object]:
        tokens: dict[str, int] = {"device": self.device}
        tokens.update(self.by_tier)
        tokens["recomputed"] = max(0, self.prompt_tokens - self.device - self.loaded())
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": tokens,
            "failed_load_tokens": self.failed_load,
            "skipped_slower_than_recompute": dict(self.skipped),
            "stored_chunks": self.stored_chunks,
        }


@dataclass
class ReqState:
    info: RequestInfo
    keys: list[ChunkKey] | None = None
    plan: HitPlan | None = None
    asked_at: int | None = None
    """``num_computed`` (vLLM's own hit) of vLLM's last question about this request."""
    looked_up: bool = False
    """Counted in ``query_tokens`` (once per request)."""
    load: LoadState | None = None
    generated_keys: list[ChunkKey] | None = None
    """Keys of the prompt's chunks and, beyond them, of the chunks of generated tokens the
    request stored (with a decode retention, or ``store_generated``)."""
    stored_upto: int = 0
    """Chunks [0, stored_upto) were considered for storing already."""
    in_kvtier: set[int] = field(default_factory=set)
    """Chunks this request loaded from kvtier: they are stored there, so they are not
    reserved again (a failed load takes its chunks out again: they are recomputed)."""
    accounting: Accounting | None = None
    finished: bool = False
    load_failed: bool = False
    """A load of this request failed; it is not offered kvtier hits again (vLLM would
    re-admit it and, if the failure is deterministic, loop on it)."""

    @property
    def req_id(self) -> str:
        return self.info.req_id
