"""Tier sizes (tokens, bytes, inf) and KV bytes per token from a model's config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.trace.sizes import bytes_per_token_from_model, show_tokens, size_chunks


def test_tokens() -> None:
    """3Mtok = 3,000,000 tokens = 5859 whole 512-token chunks (5859.375 rounded down)."""
    assert size_chunks("3Mtok", 512, None) == 5859
    assert size_chunks("500ktok", 256, None) == 1953
    assert size_chunks("1024tok", 512, None) == 2


def test_bytes_need_bytes_per_token() -> None:
    """64 GiB at 128 KiB per token = 2**36 / 2**17 = 524,288 tokens = 1024 chunks of 512."""
    assert size_chunks("64GiB", 512, 131072) == 1024
    with pytest.raises(ConfigError, match="--bytes-per-token or --model"):
        size_chunks("64GiB", 512, None, "--tier host")


def test_inf_is_unbounded() -> None:
    assert size_chunks("inf", 512, None) is None


@pytest.mark.parametrize("bad", ["", "lots", "3Mbananas", "-5tok", "12 parsecs"])
def test_bad_sizes_say_what_is_expected(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"--tier disk: expected a size such as 3Mtok"):
        size_chunks(bad, 512, 2, "--tier disk")


def test_show_tokens_reads_back() -> None:
    shown = [show_tokens(t) for t in (None, 999, 3_000_000, 999_936, 9_999_872, 286_000)]
    assert shown == ["inf", "999tok", "3.00Mtok", "1.00Mtok", "10.0Mtok", "286ktok"]


def model_dir(tmp_path: Path, config: dict[str, object]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_bytes_per_token_defaults(tmp_path: Path) -> None:
    """No num_key_value_heads -> 8 (= attention heads); no head_dim -> 512 / 8 = 64.
    2 * 4 layers * 8 heads * 64 * 2 bytes (float16) = 8192."""
    path = model_dir(tmp_path, {"num_hidden_layers": 4, "num_attention_heads": 8,
                                "hidden_size": 512, "torch_dtype": "float16"})
    assert bytes_per_token_from_model(path) == 8192


def test_bytes_per_token_llama3_8b(tmp_path: Path) -> None:
    """Llama-3-8B: 2 * 32 layers * 8 KV heads * (4096 / 32 = 128) * 2 (bf16) = 131072 (128 KiB);
    an fp8 KV cache halves it to 65536."""
    path = model_dir(tmp_path, {"num_hidden_layers": 32, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "hidden_size": 4096,
                                "torch_dtype": "bfloat16"})
    assert bytes_per_token_from_model(path / "config.json") == 131072
    assert bytes_per_token_from_model(path, "fp8") == 65536


def test_explicit_head_dim_and_text_config(tmp_path: Path) -> None:
    """head_dim given (256, not 2048 / 16 = 128), inside text_config, dtype from the outer
    config: 2 * 2 layers * 4 KV heads * 256 * 4 bytes (float32) = 16384."""
    text = {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 4,
            "hidden_size": 2048, "head_dim": 256}
    path = model_dir(tmp_path, {"text_config": text, "torch_dtype": "float32"})
    assert bytes_per_token_from_model(path) == 16384


def test_bad_model_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        bytes_per_token_from_model(model_dir(tmp_path, {"num_attention_heads": 8}))
    with pytest.raises(ConfigError, match="cannot read"):
        bytes_per_token_from_model(tmp_path / "missing")
    config = {"num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 8,
              "torch_dtype": "float4"}
    with pytest.raises(ConfigError, match="unknown KV dtype 'float4'"):
        bytes_per_token_from_model(model_dir(tmp_path, config))
