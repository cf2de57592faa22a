"""A small demo model built locally: Llama architecture, seeded random weights.

It exists so that ``kvtier serve`` and the end-to-end tests run with no download. The weights
are random, so the text it generates is nonsense, but its KV cache has the real shape and
cost of a Llama model: 4 layers, hidden 256, 2 KV heads, positions up to 32K, so an 8K-token
prefill takes a few seconds on two CPU cores and reloading its KV is measurably cheaper.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on ``corpus.txt`` (text written
for this package). The model is built once into ``~/.cache/kvtier/demo-model`` (or
``$KVTIER_CACHE_DIR/demo-model``) and reused; a recipe version in ``kvtier-demo.json`` forces a
rebuild when the recipe changes. Building imports torch and transformers, so this module
imports them lazily.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

RECIPE_VERSION = 1
MARKER = "kvtier-demo.json"
DEMO_NAME = "kvtier-demo"
"""The name ``kvtier serve`` serves the demo model under (``--served-model-name``)."""


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that determines the demo model's bytes."""

    seed: int = 1234
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 32768
    initializer_range: float = 0.05
    version: int = RECIPE_VERSION


def default_cache_dir() -> Path:
    base = os.environ.get("KVTIER_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def demo_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(cache_dir) if cache_dir else default_cache_dir() / "demo-model"


def ensure_demo_model(path: str | os.PathLike[str] | None = None,
                      recipe: DemoRecipe | None = None) -> Path:
    """The demo model's directory, building it first if it is missing or stale."""
    recipe = recipe or DemoRecipe()
    target = demo_model_path(path)
    if _is_current(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: a half-built model is never picked up, and two
    # processes building at once both end with a complete directory.
    staging = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=target.parent))
    try:
        _build(staging, recipe)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_current(target, recipe):  # lost a race to a stale or broken copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_current(path: Path, recipe: DemoRecipe) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return bool(marker == asdict(recipe))


def corpus_text() -> str:
    return resources.files("kvtier.demo").joinpath("corpus.txt").read_text(encoding="utf-8")


def _build(out: Path, recipe: DemoRecipe) -> None:
    tokenizer = _train_tokenizer(recipe)
    tokenizer.save_pretrained(str(out))
    _build_weights(out, recipe, vocab_size=len(tokenizer))
    (out / MARKER).write_text(json.dumps(asdict(recipe), indent=2) + "\n")


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _train_tokenizer(recipe: DemoRecipe):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=recipe.max_positions,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_weights(out: Path, recipe: DemoRecipe, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.hidden_size // recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        initializer_range=recipe.initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config)
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
