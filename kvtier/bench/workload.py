"""The multi-round workload: simulated users in multi-turn conversations.

Each user's conversation, as the engine sees it in round ``r`` (0-based)::

    system     the shared system prompt              (same text for every user)
    user       the user's own history + question 0   (history: unique per user)
    assistant  answer 0                              (what the endpoint answered)
    ...
    user       question r

so every request repeats the previous one of its user, plus that request's answer and a new
question: the prefix grows round by round, and only a cache that kept it since the user's last
turn saves recomputing it. Turns are scheduled round-major (all users' round 0, then all round
1, ...): between two turns of one user, every other user speaks once, which is the hard case
for an LRU device cache. Within a round users speak in the same order every round
(``user_order="fixed"``) or each round in an order of its own (``"shuffled"``, seeded): with
the fixed order and an even number of users, a round-robin router in front of two instances
sends every user to the same instance every round — session affinity by accident, which no
fleet of independent users gives it — so fleets are measured shuffled. A share of users
(``long_fraction``) carries a longer history, mixing long and short requests.

Text is synthetic (:mod:`kvtier.bench.textgen`, deterministic in ``seed``) or taken from
ShareGPT conversations (:mod:`kvtier.bench.sharegpt`): the human turns are the questions and
each answer's ``max_tokens`` is the length of the recorded reply (at most ``answer_tokens``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvtier.bench.textgen import text_of
from kvtier.bench.tokens import TokenCounter
from kvtier.errors import ConfigError

Dataset = Literal["synthetic", "sharegpt"]
UserOrder = Literal["fixed", "shuffled"]
Message = dict[str, str]


@dataclass(frozen=True)
class WorkloadConfig:
    num_users: int = 10
    num_rounds: int = 5
    system_prompt_tokens: int = 1000
    user_history_tokens: int = 2000
    question_tokens: int = 50
    answer_tokens: int = 100
    long_fraction: float = 0.0
    """Share of users whose history is ``long_history_tokens`` instead."""
    long_history_tokens: int = 8000
    warmup_rounds: int = 0
    """Each user's first rounds run before the measured ones and are left out of figures."""
    dataset: Dataset = "synthetic"
    max_question_tokens: int = 1024
    """ShareGPT only: longer human turns are cut to this."""
    seed: int = 0
    user_order: UserOrder = "fixed"
    """The order users speak in within a round: the same every round, or shuffled per round."""

    def __post_init__(self) -> None:
        for name in ("num_users", "num_rounds", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{_flag(name)} must be at least 1")
        for name in ("system_prompt_tokens", "user_history_tokens", "question_tokens",
                     "long_history_tokens", "warmup_rounds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} cannot be negative")
        if self.question_tokens < 1 and self.dataset == "synthetic":
            raise ConfigError("--question-len must be at least 1")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ConfigError("--long-fraction must be in [0, 1]")
        if self.warmup_rounds >= self.num_rounds:
            raise ConfigError(f"--warmup-rounds ({self.warmup_rounds}) must be less than "
                              f"--num-rounds ({self.num_rounds}): nothing would be measured")
        if self.dataset not in ("synthetic", "sharegpt"):
            raise ConfigError(f"--dataset: got {self.dataset!r}; allowed: synthetic, sharegpt")
        if self.user_order not in ("fixed", "shuffled"):
            raise ConfigError(f"--user-order: got {self.user_order!r}; allowed: fixed, shuffled")


_FLAGS = {"system_prompt_tokens": "shared-system-prompt",
          "user_history_tokens": "user-history-prompt", "question_tokens": "question-len",
          "answer_tokens": "answer-len", "long_history_tokens": "long-history-prompt"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, name.replace("_", "-"))


@dataclass(frozen=True)
class Turn:
    user: int
    round: int
    warmup: bool


@dataclass(frozen=True)
class Conversation:
    """One user's script: everything but the answers, which come from the endpoint."""

    user: int
    long: bool
    history: str
    questions: tuple[str, ...]
    answer_tokens: tuple[int, ...]
    """``max_tokens`` of each round's request."""


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    system_prompt: str
    conversations: tuple[Conversation, ...]

    def schedule(self) -> list[Turn]:
        """Every turn, round-major: ``(0, 0), (1, 0), ..., (n-1, 0), (0, 1), ...``; with
        ``user_order="shuffled"`` each round's users in an order of their own (the same for
        a given seed)."""
        warm = self.config.warmup_rounds
        turns = []
        for r in range(self.config.num_rounds):
            users = [c.user for c in self.conversations]
            if self.config.user_order == "shuffled":
                random.Random(f"kvtier-multiround:{self.config.seed}:order:{r}").shuffle(users)
            turns += [Turn(u, r, r < warm) for u in users]
        return turns

    def messages(self, user: int, round_: int, answers: Sequence[str]) -> list[Message]:
        """The chat messages of ``user``'s turn ``round_``, given its earlier answers."""
        conv = self.conversations[user]
        if len(answers) < round_:
            raise ValueError(f"user {user} round {round_} needs {round_} answers")
        out: list[Message] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        for r in range(round_ + 1):
            question = conv.questions[r]
            if r == 0 and conv.history:
                question = f"{conv.history}\n\n{question}"
            out.append({"role": "user", "content": question})
            if r < round_:
                out.append({"role": "assistant", "content": answers[r]})
        return out

    def prompt(self, user: int, round_: int, answers: Sequence[str]) -> str:
        """The same turn as one completion prompt (for endpoints without a chat template)."""
        parts = []
        for m in self.messages(user, round_, answers):
            role = {"system": "System", "user": "User", "assistant": "Assistant"}[m["role"]]
            parts.append(f"{role}: {m['content']}\n")
        return "".join(parts) + "Assistant:"


def long_users(num_users: int, fraction: float) -> set[int]:
    """``round(fraction * num_users)`` users, spread evenly over the index range."""
    return {i for i in range(num_users)
            if int((i + 1) * fraction + 1e-9) > int(i * fraction + 1e-9)}


def build(config: WorkloadConfig, counter: TokenCounter,
          dialogues: Sequence[Sequence[tuple[str, str]]] | None = None) -> Workload:
    """The workload for ``config``; ``dialogues`` (human, reply) pairs for ``sharegpt``."""
    if config.dataset == "sharegpt" and dialogues is None:
        raise ConfigError("--dataset sharegpt: no conversations loaded")

    def rng(*what: object) -> random.Random:
        return random.Random(":".join(map(str, ("kvtier-multiround", config.seed, *what))))

    system = text_of(counter, config.system_prompt_tokens, rng("system"),
                     "You are a helpful assistant. Background for every conversation:")
    longs = long_users(config.num_users, config.long_fraction)
    conversations = []
    for u in range(config.num_users):
        long = u in longs
        size = config.long_history_tokens if long else config.user_history_tokens
        history = text_of(counter, size, rng("history", u),
                          f"Notes of user {u} from earlier sessions (seed {config.seed}):")
        if dialogues is None:
            questions = tuple(text_of(counter, config.question_tokens, rng("q", u, r),
                                      f"Question {r + 1} from user {u}:")
                              for r in range(config.num_rounds))
            answers = (config.answer_tokens,) * config.num_rounds
        else:
            dialogue = dialogues[u % len(dialogues)]
            questions = tuple(counter.cut(q, config.max_question_tokens)
                              for q, _ in dialogue[: config.num_rounds])
            answers = tuple(max(1, min(config.answer_tokens, counter.count(a)))
                            for _, a in dialogue[: config.num_rounds])
        conversations.append(Conversation(u, long, history, questions, answers))
    return Workload(config, system, tuple(conversations))
