"""Retention hints for a replay: the trace's own, none, or derived as a router or an oracle
would derive them.

A hint is what a request's ``kv_transfer_params.kvtier`` would carry (:mod:`kvtier.hints`):
a retention (priority, seconds) for its prompt, or an end (release). ``kvtier trace
simulate`` replays them through the store's placement core. Sources (``--hints``)::

    trace              the trace's own fields (session_id, retention, end, stop_reason)
    none               no hints: every block at the default priority
    router:TTL         what the router knows: an answer that ended in tool calls is a session
                       that continues within seconds (retain at PRIORITY for TTL s); any other
                       (an end of turn) gets none; a session's explicit end releases
    session[:TOOL_S,STOP_S[,STOP_PRIORITY]]
                       what the router sets when it is told the model's tool-call tokens
                       (``kvtier route --session-tool-tokens``): nothing while a request
                       runs; when its answer ends, if it ended in tool calls its prompt is
                       set to PRIORITY for TOOL_S (default 80 for 20 s: the next turn comes
                       while the tool runs), else (any other known stop reason) to
                       STOP_PRIORITY for STOP_S (default 35: nothing); an unknown one
                       changes nothing; an explicit end releases
    session-prev[:TOOL_S,STOP_S[,STOP_PRIORITY]]
                       what the router sets without the tool-call tokens: the engine cannot
                       tell an answer's kind, so a request gets what its session's previous
                       answer earned, while it runs and again when it ends
                       An ``end`` in the trace stands for the client's own release (the
                       router sends nothing when a session ends)
    continues:T        an oracle: a request whose session's next request comes within T s
                       is retained for T s; one whose session does not continue within T is
                       released (what the bound "oracle-which" knows, delivered through the
                       retention channel)

A request's session is its ``session_id``; without one, the conversation it extends: the
latest earlier request whose first blocks (at least ``MIN_SHARED``, the first being a
shared system prompt) it starts with, as ``docs/results/eviction-bounds/bounds.py`` finds
conversations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from kvtier.errors import ConfigError
from kvtier.policies.retention import (
    DEFAULT_PRIORITY,
    MAX_RETAIN_S,
    check_duration,
    check_priority,
)
from kvtier.trace.formats import Request

HINT_PRIORITY = 80
"""The priority derived hints retain at (TensorRT-LLM's scale: above the default 35)."""
MIN_SHARED = 2
"""Leading blocks a request must share with an earlier one to continue its conversation."""
TOOL_STOPS = frozenset({"tool_calls", "tool_use", "function_call"})
SOURCES = ("trace", "none", "session[:TOOL_S,STOP_S[,STOP_PRIORITY]]",
           "session-prev[:TOOL_S,STOP_S[,STOP_PRIORITY]]", "router:TTL", "continues:T")
SESSION_TOOL_S = 20.0
"""How long the router keeps a prefix after an answer that ended in tool calls (its
``--session-tool-s``)."""
SESSION_STOP_S = 600.0
"""How long the router keeps a prefix after an answer that ended a turn."""
SESSION_STOP_PRIORITY = 35
"""The priority of a prefix whose last answer ended a turn (the router's
``--session-turn-priority``): the default, so nothing."""


@dataclasses.dataclass(frozen=True)
class SessionHints:
    """The ``session`` source's retentions: after tool calls, and after an end of turn."""

    tool: tuple[int, float]
    stop: tuple[int, float]


def parse_source(text: str) -> tuple[str, float | None]:
    """``--hints`` as (kind, seconds); ConfigError naming what is allowed otherwise."""
    kind, _, arg = text.partition(":")
    if kind in ("session", "session-prev"):
        parse_session(text)
        return kind, None
    if kind in ("trace", "none") and not arg:
        return kind, None
    if kind in ("router", "continues") and arg:
        try:
            return kind, check_duration(_seconds(arg))
        except ValueError as exc:
            raise ConfigError(f"--hints {text}: {exc}") from exc
    raise ConfigError(f"--hints: expected one of {', '.join(SOURCES)} (seconds in (0, "
                      f"{MAX_RETAIN_S:g}] or 'inf' for the longest), got {text!r}")


def parse_session(text: str, priority: int = HINT_PRIORITY) -> SessionHints:
    """``session[:TOOL_S,STOP_S[,STOP_PRIORITY]]`` as its two retentions."""
    _, _, arg = text.partition(":")
    parts = arg.split(",") if arg else []
    if len(parts) not in (0, 2, 3):
        raise ConfigError(f"--hints {text}: expected session or session:TOOL_S,STOP_S"
                          "[,STOP_PRIORITY], as in session:20,600,50 (session-prev the same)")
    try:
        tool_s = check_duration(_seconds(parts[0])) if parts else SESSION_TOOL_S
        stop_s = check_duration(_seconds(parts[1])) if parts else SESSION_STOP_S
        stop_priority = check_priority(int(parts[2]) if len(parts) == 3 else
                                       SESSION_STOP_PRIORITY)
    except ValueError as exc:
        raise ConfigError(f"--hints {text}: {exc}") from exc
    assert tool_s is not None and stop_s is not None
    return SessionHints((priority, tool_s), (stop_priority, stop_s))


def _seconds(arg: str) -> float:
    if arg in ("inf", "max"):
        return MAX_RETAIN_S
    try:
        return float(arg.removesuffix("s"))
    except ValueError as exc:
        raise ValueError(f"duration_s must be a number of seconds, got {arg!r}") from exc


def apply_hints(requests: Sequence[Request], source: str,
                priority: int = HINT_PRIORITY) -> list[Request]:
    """``requests`` with the hints of ``source`` (see the module docstring)."""
    kind, seconds = parse_source(source)
    if kind == "trace":
        return list(requests)
    if kind == "none":
        return [dataclasses.replace(r, retention=None, end=False, finish=None)
                for r in requests]
    if kind in ("session", "session-prev"):
        return session_hints(requests, parse_session(source, priority),
                             at_finish=kind == "session")
    assert seconds is not None
    if kind == "router":
        return [_routed(r, priority, seconds) for r in requests]
    after = next_in_session(requests)
    out = []
    for i, r in enumerate(requests):
        j = after[i]
        soon = j is not None and requests[j].ts_s - r.ts_s <= seconds
        out.append(dataclasses.replace(r, retention=(priority, seconds) if soon else None,
                                       end=not soon))
    return out


def _routed(r: Request, priority: int, ttl_s: float) -> Request:
    tool = r.stop_reason in TOOL_STOPS
    return dataclasses.replace(r, retention=(priority, ttl_s) if tool and not r.end else None)


def session_hints(requests: Sequence[Request], hints: SessionHints,
                  at_finish: bool = True) -> list[Request]:
    """The router's hints from the stop reasons (see the module docstring). ``at_finish``
    (told the tool-call tokens): a request's prompt is set, when it is answered, to what its
    own answer earns. Else each request gets what its session's previous answer earned,
    while it runs and again at its end."""
    earned: dict[Hashable, tuple[int, float] | None] = {}
    out = []
    for r, session in zip(requests, sessions(requests), strict=True):
        now = _earned(r.stop_reason, hints)
        if at_finish:
            out.append(dataclasses.replace(r, retention=None,
                                           finish=None if r.end else _sent(now)))
        else:  # the router sends it as the request's retention, set again at its end
            out.append(dataclasses.replace(r, retention=_sent(earned.get(session)),
                                           finish=None))
        if now is not None:
            earned[session] = now
    return out


def _sent(retention: tuple[int, float] | None) -> tuple[int, float] | None:
    """What the router sends for ``retention``: nothing at or below the default."""
    return retention if retention is not None and retention[0] > DEFAULT_PRIORITY else None


def _earned(stop: str | None, hints: SessionHints) -> tuple[int, float] | None:
    if stop is None:
        return None  # the recording lost it: nothing is known, nothing changes
    return hints.tool if stop in TOOL_STOPS else hints.stop


def sessions(requests: Sequence[Request]) -> list[Hashable]:
    """Each request's session: its ``session_id``, else the first request of the
    conversation it extends."""
    owner: dict[Hashable, int] = {}
    root: list[Hashable] = []
    for i, r in enumerate(requests):
        if r.session is not None:
            root.append(("id", r.session))
        else:
            k, last = 0, None
            while k < len(r.blocks) and r.blocks[k] in owner:
                last = owner[r.blocks[k]]
                k += 1
            root.append(root[last] if last is not None and k >= MIN_SHARED else ("req", i))
        for block in r.blocks:
            owner[block] = i
    return root


def next_in_session(requests: Sequence[Request]) -> list[int | None]:
    """The index of each request's next request in its session (``None``: it is the last)."""
    after: list[int | None] = [None] * len(requests)
    latest: dict[Hashable, int] = {}
    for i, session in enumerate(sessions(requests)):
        before = latest.get(session)
        if before is not None:
            after[before] = i
        latest[session] = i
    return after
