"""Sizing arena slots before vLLM starts, from the model's ``config.json``.

``kvtier serve`` runs the node server in its own process (so the arena is freed however vLLM
exits), which means slots are sized before vLLM has resolved the real KV layout. The
estimate is the usual K+V size of a chunk in the dtype vLLM will pick, so it is exact for
standard attention and errs on the large side otherwise (never too small for them). The
connector checks the real size against the server's slots at startup, and says when the
slots are much larger than a chunk (arena memory wasted).

``--dtype auto`` follows vLLM's rule (``_resolve_auto_dtype`` in ``vllm/config/model.py``):
the config's dtype, except that a float32 model, or one whose config names no dtype (which
transformers reads as float32), is downcast to the platform's preferred dtype, 16-bit on
every platform vLLM 0.32 supports (bfloat16 on CPU and recent GPUs, float16 otherwise).
Sizing those as float32 would give every slot twice the room a chunk needs and waste half
of the arena.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "fp16": 2, "bf16": 2,
}

AUTO_FROM_FLOAT32 = 2
"""Bytes per element vLLM's ``--dtype auto`` gives a float32 model: its 16-bit preferred dtype."""


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The last value given to any of ``names`` (``--x v`` or ``--x=v``) in a vLLM argv."""
    value: str | None = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def estimate_payload_len(model_dir: str, vllm_args: Sequence[str], chunk_tokens: int
                         ) -> int | None:
    """Bytes of one chunk's payload, or None when the config cannot be read."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    tp = int(flag_value(vllm_args, "--tensor-parallel-size", "-tp") or 1)
    kv_heads = max(heads, tp)  # fewer KV heads than ranks are replicated, one per rank
    return layers * 2 * kv_heads * head_dim * chunk_tokens * _elem_bytes(config, vllm_args)


def _elem_bytes(config: dict[str, Any], vllm_args: Sequence[str]) -> int:
    kv_dtype = flag_value(vllm_args, "--kv-cache-dtype") or "auto"
    if kv_dtype.startswith("fp8"):
        return 1
    dtype = flag_value(vllm_args, "--dtype") or "auto"
    if dtype == "auto":
        named = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        elem = _DTYPE_BYTES.get(named.removeprefix("torch."), 4)
        return AUTO_FROM_FLOAT32 if elem == 4 else elem
    return _DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)
