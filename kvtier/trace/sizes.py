"""Tier sizes in tokens, bytes or ``inf``, and the KV bytes per token a model layout implies.

A tier holds whole chunks, so every size becomes a chunk count rounded down::

    3Mtok   -> 3_000_000 // block_tokens
    64GiB   -> 64 * 2**30 // (block_tokens * bytes_per_token)   (needs bytes per token)
    inf     -> None (unbounded)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import parse_size
from kvtier.errors import ConfigError

_TOKENS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)tok(?:ens?)?\s*$")
_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "float16": 2, "fp16": 2, "bf16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
}


def size_tokens(text: str, bytes_per_token: int | None, where: str = "size") -> int | None:
    """Tokens a size names (``None`` for ``inf``); raises ConfigError with an example."""
    raw = text.strip()
    if raw.lower() in ("inf", "infinite", "unbounded"):
        return None
    match = _TOKENS.match(raw)
    if match:
        return int(float(match.group(1)) * _TOKEN_UNITS[match.group(2).lower()])
    try:
        size = parse_size(raw, where)
    except ConfigError:
        raise ConfigError(
            f"{where}: expected a size such as 3Mtok, 500ktok, 64GiB or inf, got {text!r}"
        ) from None
    if bytes_per_token is None:
        raise ConfigError(
            f"{where}: {text!r} is a byte size; give --bytes-per-token or --model "
            "to turn it into tokens, or write the size in tokens (e.g. 3Mtok)"
        )
    return size // bytes_per_token


def size_chunks(
    text: str, block_tokens: int, bytes_per_token: int | None, where: str = "size"
) -> int | None:
    """Whole chunks of ``block_tokens`` a size holds (``None`` for ``inf``)."""
    tokens = size_tokens(text, bytes_per_token, where)
    return None if tokens is None else tokens // block_tokens


def bytes_per_token_from_config(config: Mapping[str, Any], dtype: str | None = None) -> int:
    """2 (K and V) * layers * KV heads * head dim * dtype bytes, from a HF ``config.json``.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (no GQA) and ``head_dim`` to
    ``hidden_size / num_attention_heads``; multimodal configs keep these in ``text_config``.
    """
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), Mapping):
        outer_dtype = config.get("torch_dtype") or config.get("dtype")
        return bytes_per_token_from_config(config["text_config"], dtype or outer_dtype)
    layers = _positive(config, "num_hidden_layers")
    heads = _positive(config, "num_attention_heads")
    kv_heads = heads
    if config.get("num_key_value_heads") is not None:
        kv_heads = _positive(config, "num_key_value_heads")
    if config.get("head_dim") is not None:
        head_dim = _positive(config, "head_dim")
    else:
        head_dim = _positive(config, "hidden_size") // heads
    name = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return 2 * layers * kv_heads * head_dim * dtype_bytes(str(name))


def bytes_per_token_from_model(path: str | Path, dtype: str | None = None) -> int:
    """Bytes per token from a model directory (or its ``config.json`` itself)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model: cannot read {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"--model: {file} does not hold a JSON object")
    return bytes_per_token_from_config(config, dtype)


def dtype_bytes(name: str) -> int:
    key = name.lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {name!r}; known: {', '.join(sorted(_DTYPE_BYTES))}")
    return _DTYPE_BYTES[key]


def _positive(config: Mapping[str, Any], name: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model config: {name!r} must be a positive integer, got {value!r}")
    return value


def show_tokens(tokens: float | None) -> str:
    """``3.0Mtok`` style, the inverse of the size grammar (``inf`` for unbounded)."""
    if tokens is None:
        return "inf"
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if tokens >= scale * 0.9995:  # 1Mtok in 512-token chunks is 999,936: still "1.00M"
            return f"{_three_digits(tokens / scale)}{unit}tok"
    return f"{tokens:.0f}tok"


def show_bytes(size: float | None) -> str:
    if size is None:
        return "-"
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{_three_digits(size / scale)}{unit}"
    return f"{size:.0f}B"


def _three_digits(value: float) -> str:
    """About three significant digits without exponent notation: 1000, 286, 24.8, 8.44."""
    if value >= 99.95:
        return f"{value:.0f}"
    return f"{value:.1f}" if value >= 9.995 else f"{value:.2f}"
