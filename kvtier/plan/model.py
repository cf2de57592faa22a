"""What sizing needs to know about a model, from its directory: layout and parameter count.

The KV layout comes from ``config.json`` (``text_config`` for multimodal models). The parameter
count is exact when the directory holds ``*.safetensors`` files (read from their headers:
8 bytes of length, then a JSON table of tensor shapes), otherwise estimated from the config
for a decoder-only transformer::

    embeddings   vocab * hidden  (and as much again for an untied LM head)
    per layer    q, o: hidden * heads * head_dim each;  k, v: hidden * kv_heads * head_dim each
                 MLP: 3 * hidden * intermediate (gated), times the experts for MoE
                 norms: 2 * hidden
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.trace.sizes import dtype_bytes


@dataclass(frozen=True)
class ModelShape:
    path: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str
    params: int
    params_exact: bool
    """Counted from safetensors headers (True) or estimated from the config (False)."""

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """K and V of one token, all layers and heads (what a host tier stores per token)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes(kv_dtype or
                                                                              self.dtype)

    def kv_bytes_per_token_per_rank(self, tp: int, kv_dtype: str | None = None) -> int:
        """One tensor-parallel rank's share: KV heads split over ranks, one per rank at least
        (fewer heads than ranks are replicated)."""
        per_rank = max(1, self.kv_heads // tp)
        return 2 * self.layers * per_rank * self.head_dim * dtype_bytes(kv_dtype or self.dtype)


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model config: {key!r} must be a positive integer, got {value!r}")
    return value


def read_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(model directory, config.json contents) from a directory or its config.json."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model: cannot read {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"--model: {file} does not hold a JSON object")
    return file.parent, config


def read_model(path: str | Path, dtype: str | None = None) -> ModelShape:
    folder, config = read_config(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    heads = _int(text, "num_attention_heads")
    hidden = _int(text, "hidden_size")
    name = dtype if dtype and dtype != "auto" else str(
        config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
        or text.get("dtype") or "bfloat16")
    if (not dtype or dtype == "auto") and name.removeprefix("torch.") in ("float32", "float"):
        name = "bfloat16"  # vLLM's auto dtype runs float32 models in 16 bits (launch/sizing.py)
    dtype_bytes(name)  # an unknown dtype is an error here, naming it
    shape = {
        "layers": _int(text, "num_hidden_layers"),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _int(text, "num_key_value_heads", heads) if text.get(
            "num_key_value_heads") is not None else heads,
        "head_dim": _int(text, "head_dim") if text.get("head_dim") is not None
        else hidden // heads,
        "intermediate": _int(text, "intermediate_size", 4 * hidden),
        "vocab": _int(text, "vocab_size"),
    }
    counted = safetensors_params(folder)
    params = counted if counted is not None else estimate_params(text, shape)
    return ModelShape(path=str(folder), dtype=name.removeprefix("torch."), params=params,
                      params_exact=counted is not None, **shape)


def estimate_params(text: Mapping[str, Any], s: Mapping[str, int]) -> int:
    hidden, vocab = s["hidden"], s["vocab"]
    embed = vocab * hidden * (1 if text.get("tie_word_embeddings") else 2)
    attn = 2 * hidden * s["heads"] * s["head_dim"] + 2 * hidden * s["kv_heads"] * s["head_dim"]
    experts = next((int(text[k]) for k in ("num_local_experts", "num_experts",
                                           "n_routed_experts") if text.get(k)), 0)
    if experts:
        width = int(text.get("moe_intermediate_size") or s["intermediate"])
        mlp = experts * 3 * hidden * width + hidden * experts
    else:
        mlp = 3 * hidden * s["intermediate"]
    return embed + s["layers"] * (attn + mlp + 2 * hidden) + hidden


def safetensors_params(folder: Path) -> int | None:
    """Parameters in the folder's safetensors files, or None when there are none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 << 20:
                    return None
                header = json.loads(f.read(length))
        except (OSError, ValueError, struct.error):
            return None
        for name, tensor in header.items():
            if name != "__metadata__" and isinstance(tensor, dict):
                total += math.prod(int(d) for d in tensor.get("shape", []))
    return total
