"""What makes two engines' KV bytes interchangeable: the namespace and the payload layout.

Both are derived from vLLM's config and its resolved KV cache config, the same way in the
scheduler and in every worker. The namespace covers everything vLLM's own block hashes leave
out (model, weights, dtype, layout, block size, parallelism, backend), so chunks from a
different checkpoint, dtype or attention backend can never match.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.vllm.metadata import PayloadLayout

PAYLOAD_FORMAT = "vllm-pages-v1"
_FULL_KV_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_SAMPLE = 1 << 20


def model_digest(model: str, revision: str | None = None) -> str:
    """A digest of a model directory's config and weights (sampled), or of its name.

    Weight files are identified by name, size and their first and last MiB: cheap for a 100
    GB checkpoint, yet any re-export changes the safetensors header at the start.
    """
    h = hashlib.sha256()
    path = Path(model)
    if not path.is_dir():
        h.update(f"name:{model}@{revision or ''}".encode())
        return h.hexdigest()[:32]
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            h.update(name.encode() + b"\0" + (path / name).read_bytes())
    for file in sorted(path.iterdir()):
        if file.suffix in (".safetensors", ".bin", ".pt", ".gguf") and file.is_file():
            h.update(_sample(file))
    return h.hexdigest()[:32]


def _sample(file: Path) -> bytes:
    size = file.stat().st_size
    h = hashlib.sha256(f"{file.name}:{size}".encode())
    with open(file, "rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
    return h.digest()


def kv_spec(kv_cache_config: Any) -> Any:
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier supports models with one KV cache group; this one has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ not in _FULL_KV_SPECS:
        # Sliding-window and state-space caches free or rewrite blocks behind the prompt:
        # a block id there is not the KV of its tokens.
        raise ConfigError(f"kvtier supports full-attention KV caches; this model's is "
                          f"{type(spec).__name__}")
    return groups[0]


def payload_layout(vllm_config: Any, kv_cache_config: Any, chunk_tokens: int
                   ) -> tuple[PayloadLayout, int]:
    """The chunk payload layout and vLLM's block size."""
    group = kv_spec(kv_cache_config)
    spec = group.kv_cache_spec
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet")
    if chunk_tokens % spec.block_size:
        raise ConfigError(f"chunk_tokens ({chunk_tokens}) must be a multiple of vLLM's block "
                          f"size ({spec.block_size})")
    layout = PayloadLayout(
        num_layers=len(group.layer_names),
        tp_size=parallel.tensor_parallel_size,
        blocks_per_chunk=chunk_tokens // spec.block_size,
        page_bytes=spec.page_size_bytes,
    )
    return layout, spec.block_size


def namespace(vllm_config: Any, kv_cache_config: Any, chunk_tokens: int,
              model_id: str | None, generation: int = 0) -> Namespace:
    """The namespace of this engine's chunks; ``generation`` changes after a cache reset."""
    from vllm.platforms import current_platform

    spec = kv_spec(kv_cache_config).kv_cache_spec
    layout, block_size = payload_layout(vllm_config, kv_cache_config, chunk_tokens)
    mc = vllm_config.model_config
    extra = {
        "device": str(current_platform.device_type),
        "page_bytes": str(layout.page_bytes),
        "payload": PAYLOAD_FORMAT,
        "generation": str(generation),
        # Anything else that changes the KV bytes for the same tokens and weights files.
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_overrides": repr(getattr(mc, "hf_overrides", None)),
        "kv_spec": type(spec).__name__,
        "sliding_window": str(getattr(spec, "sliding_window", None)),
    }
    return Namespace(
        model=model_id or str(mc.model),
        model_digest=model_digest(os.path.expanduser(str(mc.model)), mc.revision),
        dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=layout.num_layers,
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        block_size=block_size,
        kv_layout=str(kv_cache_config.kv_cache_layout or "default"),
        chunk_tokens=chunk_tokens,
        tp_rank=0,  # one chunk holds every rank's pages
        tp_size=layout.tp_size,
        extra=extra,
    )
