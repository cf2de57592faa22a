"""The synthetic chat-session generator: deterministic, Mooncake-shaped, reusing prefixes."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.trace.formats import load_trace, write_mooncake
from kvtier.trace.generate import GenConfig, generate


def test_same_seed_same_trace() -> None:
    config = GenConfig(sessions=40, seed=7)
    assert generate(config) == generate(config)
    assert generate(config) != generate(GenConfig(sessions=40, seed=8))


def test_mooncake_shape_and_round_trip(tmp_path: Path) -> None:
    """ceil(input / 512) ids per request, arrivals in order, ids numbered from 0 in order of
    first use; written and read back unchanged."""
    requests = generate(GenConfig(sessions=30, seed=3))
    assert all(len(r.blocks) == math.ceil(r.input_tokens / 512) for r in requests)
    assert [r.ts_s for r in requests] == sorted(r.ts_s for r in requests)
    seen: list[int] = []
    for r in requests:
        seen.extend(b for b in r.blocks if b not in seen)  # type: ignore[misc]
    assert seen == list(range(len(seen)))
    path = tmp_path / "g.jsonl"
    with open(path, "w") as out:
        write_mooncake(requests, out)
    assert load_trace(path).requests == requests


def test_one_session_grows_its_history() -> None:
    """One session: every turn's full blocks are a prefix of the next turn's blocks, and
    the next turn is longer by the answer and a new user message."""
    requests = generate(GenConfig(sessions=1, turns=8.0, seed=4))
    assert len(requests) >= 3
    for before, after in itertools.pairwise(requests):
        full = before.blocks[: before.full_blocks]
        assert after.blocks[: len(full)] == full
        assert after.input_tokens > before.input_tokens + before.output_tokens


def test_shared_system_prompt() -> None:
    """All sessions on one shared prompt of at least 512 tokens (1024 * U(0.5, 1.5)): every
    request starts with the same block, id 0."""
    config = GenConfig(sessions=20, shared_prompt_share=1.0, system_prompts=1,
                       system_prompt_tokens=1024, seed=9)
    assert {r.blocks[0] for r in generate(config)} == {0}


def test_private_prompts_share_nothing_across_sessions() -> None:
    """shared_prompt_share=0 and one turn each: no block appears in two requests."""
    config = GenConfig(sessions=25, shared_prompt_share=0.0, turns=1.0, seed=2)
    blocks = [b for r in generate(config) for b in r.blocks]
    assert len(blocks) == len(set(blocks))


def test_bad_settings() -> None:
    with pytest.raises(ConfigError, match="shared_prompt_share"):
        GenConfig(shared_prompt_share=1.5)
    with pytest.raises(ConfigError, match="sessions must be positive"):
        GenConfig(sessions=0)
