"""A synthetic trace in Mooncake's format: chat sessions over shared system prompts.

Each session starts with a system prompt, shared with other sessions (picked by Zipf
popularity) or its own, then runs a number of turns; every turn's prompt is the whole
history so far (system prompt, earlier user messages and answers) plus a new user message::

    turn 1:  [system prompt][user 1]
    turn 2:  [system prompt][user 1][answer 1][user 2]
    turn 3:  [system prompt][user 1][answer 1][user 2][answer 2][user 3]

Block ids follow the prompt's content, as Mooncake's prefix-chained ids do: a full block inside
a shared system prompt is the same block for every session using that prompt; a full block of a
session's history is the same in all its later turns; a partial last block is new each time.
Ids are numbered 0, 1, 2, ... in order of first appearance. Everything derives from ``seed``.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.trace.formats import MOONCAKE_BLOCK_TOKENS, Request

_MAX_TURNS = 64


@dataclass(frozen=True)
class GenConfig:
    """Knobs of the workload; the reuse knobs are the first five."""

    sessions: int = 1000
    shared_prompt_share: float = 0.8
    """Sessions that open with one of the shared system prompts (the rest have their own)."""
    system_prompts: int = 20
    zipf: float = 1.0
    """Popularity skew of the shared system prompts (0 = uniform)."""
    turns: float = 4.0
    """Mean turns per session (geometric, at least one); more turns, more history reuse."""
    system_prompt_tokens: int = 2048
    user_tokens: int = 400
    output_tokens: int = 300
    session_rate: float = 1.0
    """New sessions per second (Poisson arrivals)."""
    think_time_s: float = 30.0
    """Mean gap between the turns of one session (exponential)."""
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    seed: int = 0

    def __post_init__(self) -> None:
        counts = ("sessions", "system_prompts", "system_prompt_tokens", "user_tokens",
                  "output_tokens", "block_tokens")
        for name in counts:
            if getattr(self, name) <= 0:
                raise ConfigError(f"generate: {name} must be positive")
        if not 0.0 <= self.shared_prompt_share <= 1.0:
            raise ConfigError("generate: shared_prompt_share must be in [0, 1]")
        if self.turns < 1.0 or self.zipf < 0.0:
            raise ConfigError("generate: turns must be at least 1 and zipf non-negative")
        if self.session_rate <= 0.0 or self.think_time_s < 0.0:
            raise ConfigError("generate: session_rate must be positive, think_time_s >= 0")


@dataclass(frozen=True)
class _Turn:
    ts_s: float
    session: int
    turn: int
    input_tokens: int
    output_tokens: int
    keys: tuple[tuple[int, ...], ...]


def generate(config: GenConfig) -> list[Request]:
    """The requests of ``config``'s workload in arrival order."""
    rng = random.Random(config.seed)
    prompt_lengths = [
        _around(rng, config.system_prompt_tokens) for _ in range(config.system_prompts)
    ]
    popularity = (1.0 / (k + 1) ** config.zipf for k in range(config.system_prompts))
    weights = list(itertools.accumulate(popularity))
    turns: list[_Turn] = []
    start = 0.0
    for session in range(config.sessions):
        start += rng.expovariate(config.session_rate)
        turns.extend(_session(rng, config, session, start, prompt_lengths, weights))
    turns.sort(key=lambda t: (t.ts_s, t.session, t.turn))
    return _number(turns, config.block_tokens)


def _session(
    rng: random.Random,
    config: GenConfig,
    session: int,
    start: float,
    prompt_lengths: list[int],
    weights: list[float],
) -> list[_Turn]:
    if rng.random() < config.shared_prompt_share:
        prompt = rng.choices(range(len(prompt_lengths)), cum_weights=weights)[0]
        system, owner = prompt_lengths[prompt], (0, prompt)
    else:
        system, owner = _around(rng, config.system_prompt_tokens), (1, session)
    history, ts, turns = system, start, []
    for turn in range(_turn_count(rng, config.turns)):
        prompt_tokens = history + _exp_tokens(rng, config.user_tokens)
        output = _exp_tokens(rng, config.output_tokens)
        keys = _block_keys(owner, session, system, prompt_tokens, config.block_tokens)
        turns.append(_Turn(round(ts, 3), session, turn, prompt_tokens, output, keys))
        history = prompt_tokens + output
        ts += rng.expovariate(1.0 / config.think_time_s) if config.think_time_s else 0.0
    return turns


def _block_keys(
    owner: tuple[int, int], session: int, system: int, tokens: int, block_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """A content key per block: what the block's tokens (and all before them) depend on."""
    keys: list[tuple[int, ...]] = []
    for i in range(-(-tokens // block_tokens)):
        end = (i + 1) * block_tokens
        if end <= system:
            keys.append((0, *owner, i))  # inside the system prompt: shared by its owner
        elif end <= tokens:
            keys.append((1, session, i))  # a full history block: stable for later turns
        else:
            keys.append((2, session, i, tokens))  # partial: new content every turn
    return tuple(keys)


def _number(turns: list[_Turn], block_tokens: int) -> list[Request]:
    ids: dict[tuple[int, ...], int] = {}
    requests = []
    for t in turns:
        blocks = tuple(ids.setdefault(key, len(ids)) for key in t.keys)
        requests.append(Request(t.ts_s, t.input_tokens, t.output_tokens, blocks, block_tokens))
    return requests


def _turn_count(rng: random.Random, mean: float) -> int:
    count = 1
    while count < _MAX_TURNS and rng.random() >= 1.0 / mean:
        count += 1
    return count


def _exp_tokens(rng: random.Random, mean: int) -> int:
    return max(1, int(rng.expovariate(1.0 / mean)))


def _around(rng: random.Random, mean: int) -> int:
    """A length spread evenly over half to one and a half times ``mean``."""
    return max(1, int(mean * rng.uniform(0.5, 1.5)))
