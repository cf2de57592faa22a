"""The agent workload: sessions of tool-call turns and idle gaps, on a scaled clock.

Each session is an agent's conversation, as the engine sees it at turn ``t``::

    system     the shared system prompt (the agent's tools)      same text for every session
    user       the session's task and context                    unique per session
    assistant  answer 0                                          what the endpoint answered
    user       tool result 1 (after a tool call) or a new user message (after an end of turn)
    ...        one answer and one such message per earlier turn

so every turn repeats its session's previous prompt plus that answer and a little more. The
demo model never emits tool calls, so the workload decides each answer's kind, seeded:

- ``tool_call``: the agent runs a tool and the next turn follows after a short gap, drawn from
  a log-normal with the median and p90 of agent traces (17 s and 89 s after a tool call);
- ``end_of_turn``: the agent answered the user, who comes back after a long gap (median
  210 s; p90 ``idle_gap.p90_s``, an assumption of ours);
- ``end``: the session's last turn.

Gaps are multiplied by ``time_scale`` (0.05: a 17 s gap is 0.85 s) and capped at
``max_gap_s`` (trace seconds), so a run takes minutes. Sessions start spread over
``arrival_window_s`` (run seconds), so more of them are live at once than the arena holds.

With retention on, each request says through ``kv_transfer_params.kvtier`` how long its
prefix is worth keeping, as the client knows the answer's kind (:class:`RetentionPlan`): a
tool call, high priority for a short time; an end of turn, a lower priority for longer; the
session's end, ``release``. Off, the same requests carry no such field.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.bench.textgen import text_of
from kvtier.bench.tokens import TokenCounter
from kvtier.errors import ConfigError
from kvtier.hints import parse_retention

Kind = Literal["tool_call", "end_of_turn", "end"]
KINDS: tuple[Kind, ...] = ("tool_call", "end_of_turn", "end")
Z90 = 1.2815515655446004
"""The standard normal's 90th percentile."""
Message = dict[str, str]


@dataclass(frozen=True)
class GapShape:
    """A log-normal gap by its median and p90, in trace seconds."""

    median_s: float
    p90_s: float

    def __post_init__(self) -> None:
        if not 0 < self.median_s <= self.p90_s:
            raise ConfigError(f"a gap needs 0 < median <= p90, got median {self.median_s}, "
                              f"p90 {self.p90_s}")

    def draw(self, rng: random.Random) -> float:
        sigma = math.log(self.p90_s / self.median_s) / Z90
        return self.median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


@dataclass(frozen=True)
class RetentionPlan:
    """What the client says after each kind of answer (durations in trace seconds, scaled
    like the gaps)."""

    tool_priority: int = 90
    tool_duration_s: float = 120.0
    """Past the tool gap's p90 (89 s)."""
    idle_priority: int = 60
    idle_duration_s: float = 900.0
    release_at_end: bool = True

    def params(self, kind: Kind, time_scale: float) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params`` for an answer of ``kind``."""
        if kind == "end":
            return {"kvtier": {"release": True}} if self.release_at_end else None
        priority, duration = ((self.tool_priority, self.tool_duration_s) if kind == "tool_call"
                              else (self.idle_priority, self.idle_duration_s))
        retention = {"priority": priority, "duration_s": round(duration * time_scale, 3)}
        parse_retention(retention)  # the plan's own values: refused here, not by the server
        return {"kvtier": {"retention": retention}}


@dataclass(frozen=True)
class AgentsConfig:
    sessions: int = 40
    turns: int = 6
    """Requests per session; the last one ends it."""
    system_prompt_tokens: int = 256
    context_tokens: int = 1536
    """The session's own opening (task, files): what a lost prefix costs to recompute."""
    tool_result_tokens: int = 160
    user_message_tokens: int = 48
    answer_tokens: int = 12
    tool_call_share: float = 0.75
    """Of the turns that do not end the session, the share that end in a tool call."""
    time_scale: float = 0.05
    arrival_window_s: float = 90.0
    """Run seconds over which the sessions start (evenly, with seeded jitter)."""
    tool_gap: GapShape = field(default_factory=lambda: GapShape(17.0, 89.0))
    idle_gap: GapShape = field(default_factory=lambda: GapShape(210.0, 400.0))
    max_gap_s: float = 600.0
    """Trace seconds; longer draws are cut to this."""
    seed: int = 0
    plan: RetentionPlan = field(default_factory=RetentionPlan)

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.answer_tokens < 1:
            raise ConfigError("--sessions, --turns and --answer-len must be at least 1")
        for name in ("system_prompt_tokens", "context_tokens", "tool_result_tokens",
                     "user_message_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} cannot be negative")
        if not 0.0 <= self.tool_call_share <= 1.0:
            raise ConfigError(f"--tool-call-share must be in [0, 1], got {self.tool_call_share}")
        if not 0.0 < self.time_scale <= 1.0:
            raise ConfigError(f"--time-scale must be in (0, 1], got {self.time_scale}")
        if self.arrival_window_s < 0 or self.max_gap_s <= 0:
            raise ConfigError("--arrival-window cannot be negative, --max-gap must be positive")


@dataclass(frozen=True)
class Session:
    """One agent's script: everything but the answers, which come from the endpoint."""

    index: int
    start_s: float
    """Run seconds at which its first request goes out."""
    context: str
    kinds: tuple[Kind, ...]
    """The kind of each turn's answer; the last is ``end``."""
    gaps_s: tuple[float, ...]
    """Run seconds between an answer and the next turn (one fewer than the turns)."""
    messages_after: tuple[str, ...]
    """The message that opens turn ``t + 1``: a tool result or a user's message."""


@dataclass(frozen=True)
class AgentsWorkload:
    config: AgentsConfig
    system_prompt: str
    sessions: tuple[Session, ...]

    def messages(self, session: int, turn: int, answers: Sequence[str]) -> list[Message]:
        """The chat messages of ``session``'s turn ``turn``, given its earlier answers."""
        s = self.sessions[session]
        if len(answers) < turn:
            raise ValueError(f"session {session} turn {turn} needs {turn} answers")
        out: list[Message] = []
        if self.system_prompt:
            out.append({"role": "system", "content": self.system_prompt})
        out.append({"role": "user", "content": s.context})
        for t in range(turn):
            out.append({"role": "assistant", "content": answers[t]})
            out.append({"role": "user", "content": s.messages_after[t]})
        return out

    def params(self, session: int, turn: int, retention: bool) -> dict[str, Any] | None:
        """The turn's ``kv_transfer_params``: the plan's for its answer's kind, or none."""
        if not retention:
            return None
        return self.config.plan.params(self.sessions[session].kinds[turn],
                                       self.config.time_scale)

    def after(self, session: int, turn: int) -> str:
        """What the turn follows: ``start``, or the previous answer's kind."""
        return "start" if turn == 0 else self.sessions[session].kinds[turn - 1]


def build(config: AgentsConfig, counter: TokenCounter) -> AgentsWorkload:
    """The workload of ``config``: the same seed gives the same sessions, text and gaps."""
    def rng(*what: object) -> random.Random:
        return random.Random(":".join(map(str, ("kvtier-agents", config.seed, *what))))

    system = text_of(counter, config.system_prompt_tokens, rng("system"),
                     "You are a coding agent. Tools: read_file, run_tests, search, edit.")
    step = config.arrival_window_s / config.sessions
    sessions = []
    for i in range(config.sessions):
        r = rng("script", i)
        kinds: list[Kind] = ["tool_call" if r.random() < config.tool_call_share
                             else "end_of_turn" for _ in range(config.turns - 1)]
        kinds.append("end")
        gaps = tuple(config.time_scale * min(config.max_gap_s, (
            config.tool_gap if k == "tool_call" else config.idle_gap).draw(r))
            for k in kinds[:-1])
        follow = tuple(
            text_of(counter, config.tool_result_tokens, rng("tool", i, t),
                    f"Tool result {t + 1} of session {i}:") if k == "tool_call" else
            text_of(counter, config.user_message_tokens, rng("user", i, t),
                    f"Message {t + 1} from the user of session {i}:")
            for t, k in enumerate(kinds[:-1]))
        context = text_of(counter, config.context_tokens, rng("context", i),
                          f"Task of session {i} (seed {config.seed}):")
        start = step * i + r.uniform(0.0, step)
        sessions.append(Session(i, start, context, tuple(kinds), gaps, follow))
    return AgentsWorkload(config, system, tuple(sessions))
