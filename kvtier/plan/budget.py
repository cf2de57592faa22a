"""The sizing arithmetic: device KV budget, host headroom, and the tiers that fit.

Device, per GPU (one tensor-parallel rank)::

    usable     = device memory * gpu_memory_utilization
    weights    = params * dtype bytes / TP     (as if on the device, offloaded or not)
    workspace  = activations + CUDA graphs + non-torch overhead (estimated, or --workspace)
                 activations = batched tokens * (4 * hidden + 2 * intermediate / TP) * dtype
                               + max_num_seqs * vocab * 4 (fp32 logits)
    KV budget  = usable - weights - workspace  ->  tokens = budget / per-rank KV bytes per
                 token, rounded down to whole blocks

Host::

    headroom = RAM - OS - page cache - co-located services - engine processes
               - weight offload (cpu_offload_gb per GPU) - margin
    arena    = headroom, in whole slots of one chunk each (header + payload, 4 KiB aligned)

Weight offloading (vLLM's ``--cpu-offload-gb``) moves *weights* to host RAM; it is never KV
capacity (:data:`CPU_OFFLOAD_NOTE`): here it only takes host RAM away from the arena. The
device memory it frees is not counted as KV space either — a setting that lets the model load
is not a KV budget, and buying KV room with it makes every forward pass fetch weights over
the host link.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.codec import stored_size
from kvtier.errors import ConfigError
from kvtier.plan.model import ModelShape
from kvtier.trace.sizes import dtype_bytes

GiB = 1 << 30
CPU_OFFLOAD_NOTE = (
    "--cpu-offload-gb offloads model weights, not KV: no KV block is ever kept there, so it "
    "is not KV capacity. kvtier plan adds nothing for it to the host KV budget (it takes that "
    "much host RAM per GPU away from the arena) nor to the device KV budget (the weights are "
    "counted as if on the device: device room bought that way makes every forward pass "
    "fetch weights over the host link). For KV in host RAM, size kvtier's arena."
)


@dataclass(frozen=True)
class DeviceInputs:
    device_bytes: int
    """Memory of one GPU."""
    gpu_memory_utilization: float = 0.9
    tp: int = 1
    max_model_len: int = 8192
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    kv_dtype: str | None = None
    cpu_offload_gb: float = 0.0
    enforce_eager: bool = False
    workspace_bytes: int | None = None
    """Override the workspace estimate (e.g. from vLLM's startup log)."""
    overhead_bytes: int = GiB
    """Non-torch memory per GPU: CUDA context, NCCL buffers, allocator slack."""
    cuda_graph_bytes: int = GiB // 2

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        for name in ("tp", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
                     "block_size", "device_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.cpu_offload_gb < 0:
            raise ConfigError("--cpu-offload-gb cannot be negative")


@dataclass(frozen=True)
class DeviceBudget:
    usable_bytes: int
    weights_bytes: int
    workspace_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    """Per rank."""
    kv_tokens: int
    full_sequences: float
    """Sequences of max_model_len the KV cache holds at once."""


@dataclass(frozen=True)
class HostInputs:
    ram_bytes: int
    os_bytes: int | None = None
    """Default: max(4 GiB, 5% of RAM)."""
    page_cache_bytes: int | None = None
    """Default: 10% of RAM."""
    colocated_bytes: int = 0
    engines: int = 1
    engine_bytes: int | None = None
    """Host memory of one engine's processes; default 2 GiB + 4 GiB per GPU."""
    margin: float = 0.1

    def __post_init__(self) -> None:
        if self.ram_bytes < 1:
            raise ConfigError("--host-ram must be positive")
        if not 0.0 <= self.margin < 1.0:
            raise ConfigError("--margin must be in [0, 1)")
        if self.engines < 1:
            raise ConfigError("--engines must be at least 1")


@dataclass(frozen=True)
class HostBudget:
    ram_bytes: int
    os_bytes: int
    page_cache_bytes: int
    colocated_bytes: int
    engines_bytes: int
    weight_offload_bytes: int
    margin_bytes: int
    headroom_bytes: int
    slot_bytes: int
    arena_slots: int
    arena_bytes: int
    arena_tokens: int


def device_budget(model: ModelShape, d: DeviceInputs) -> DeviceBudget:
    elem = dtype_bytes(model.dtype)
    usable = int(d.device_bytes * d.gpu_memory_utilization)
    weights = model.params * elem // d.tp
    workspace = d.workspace_bytes if d.workspace_bytes is not None else workspace_bytes(model, d)
    kv = usable - weights - workspace
    if kv <= 0:
        offload = (" (--cpu-offload-gb is not counted: weight offloading is not KV capacity)"
                   if d.cpu_offload_gb else "")
        raise ConfigError(
            f"no room for a KV cache: {_gib(usable)} usable per GPU, weights take "
            f"{_gib(weights)} and the runtime workspace {_gib(workspace)}{offload}; raise "
            "--tensor-parallel-size or --gpu-memory-utilization, or use a smaller model")
    per_token = model.kv_bytes_per_token_per_rank(d.tp, d.kv_dtype)
    tokens = kv // per_token // d.block_size * d.block_size
    return DeviceBudget(usable, weights, workspace, kv, per_token, tokens,
                        tokens / d.max_model_len)


def workspace_bytes(model: ModelShape, d: DeviceInputs) -> int:
    elem = dtype_bytes(model.dtype)
    act = d.max_num_batched_tokens * (4 * model.hidden + 2 * model.intermediate // d.tp) * elem
    logits = d.max_num_seqs * model.vocab * 4
    graphs = 0 if d.enforce_eager else d.cuda_graph_bytes
    return act + logits + graphs + d.overhead_bytes


def host_budget(h: HostInputs, tp: int, cpu_offload_gb: float, payload_bytes: int,
                chunk_tokens: int) -> HostBudget:
    os_bytes = h.os_bytes if h.os_bytes is not None else max(4 * GiB, h.ram_bytes // 20)
    page = h.page_cache_bytes if h.page_cache_bytes is not None else h.ram_bytes // 10
    engine = h.engine_bytes if h.engine_bytes is not None else 2 * GiB + 4 * GiB * tp
    engines = h.engines * engine
    offload = int(cpu_offload_gb * GiB) * tp * h.engines
    left = h.ram_bytes - os_bytes - page - h.colocated_bytes - engines - offload
    margin = int(max(0, left) * h.margin)
    headroom = max(0, left - margin)
    slot = stored_size(payload_bytes)
    slots = headroom // slot
    return HostBudget(h.ram_bytes, os_bytes, page, h.colocated_bytes, engines, offload, margin,
                      headroom, slot, slots, slots * slot, slots * chunk_tokens)


def payload_bytes(model: ModelShape, tp: int, chunk_tokens: int, kv_dtype: str | None = None
                  ) -> int:
    """One chunk's K and V over every rank, as the connector stores it (a rank that holds a
    replicated KV head stores its copy too): kvtier.launch.sizing's estimate."""
    heads = max(model.kv_heads, tp)
    return (model.layers * 2 * heads * model.head_dim * chunk_tokens
            * dtype_bytes(kv_dtype or model.dtype))


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
