"""Sessions: the router keeps a live session's prefix retained, and lets an ended one go.

::

    request ──► who: --session-header, else the body's ``user``, else its first messages
            ──► X-Session-End: 1 ─► forgotten, nothing set (what it held expires by itself)
            ──► kv_transfer_params.kvtier.finish += what each kind of answer earns, set by
                the connector when the answer ends:
                  tool_calls (a generated token is one of --session-tool-tokens): the next
                  turn comes within seconds, --session-tool-priority for --session-tool-s;
                  stop/length (an end of turn): --session-turn-priority for --session-turn-s
                  (by default the default priority: nothing)
    answer  ──► its finish_reason (whole or streamed) is the session's last

The engine cannot tell a tool call from an end of turn (both end on a stop token) unless it is
told the model's tool-call marker, ``--session-tool-tokens`` (e.g. Qwen's ``<tool_call>``).
Without one the router falls back to the session's previous answer: a session whose last
answer called a tool gets the tool retention (as the request's ``retention``, which the
connector sets while it runs and again at its end). The answer that ends a tool loop is kept
too, and on the public agent traces that guess loses hits (docs/results/retention-agentic), so
the router warns at start.
The connector sets a finish retention with ``keep_stronger`` (:mod:`kvtier.hints`), so no
retention of another session on a shared prefix is lowered, and it expires lazily in the
store: an idle session (no request for --session-idle-s) needs nothing sent.

The client's own ``retention``, ``priority``, ``release`` or ``finish`` wins (within its
tenant's cap): the router then adds nothing. The router's priorities are capped by the
tenant's ``max_priority`` too; a cap at or below the default (35) leaves nothing to set.
Each tenant's table holds at most --max-sessions sessions (its least recently seen leave
first), keyed by a digest, never the client's string; a session header must be 1-128 visible ASCII
characters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError
from kvtier.hints import check_tool_call_tokens
from kvtier.policies.retention import DEFAULT_PRIORITY, MAX_RETAIN_S
from kvtier.router.finish import TOOL_CALLS
from kvtier.router.metrics import RouterMetrics
from kvtier.router.tenants import BadRequest, Tenant, stamp_tenant

MAX_SESSION_CHARS = 128
MAX_USER_CHARS = 256
CLIENT_KEYS = ("retention", "priority", "release", "finish")
"""A client that sets any of these in ``kv_transfer_params.kvtier`` decides for itself."""
_TRUE = frozenset({"1", "true", "yes"})
log = logging.getLogger("kvtier.router")


@dataclass(frozen=True)
class SessionConfig:
    """``--session-*`` (docs/router-tenants.md, "Sessions")."""

    retain: bool = False
    """Whether the router sets retention for sessions at all (``--session-retention``)."""
    end_header: str = "X-Session-End"
    max_sessions: int = 10_000
    idle_s: float = 900.0
    prefix_messages: int = 2
    """Without a header or ``user``: a chat is known by its first this many messages."""
    prefix_chars: int = 2048
    """... and a completion by its prompt's first this many characters (or token ids)."""
    tool_priority: int = 80
    tool_s: float = 20.0
    """After a tool call the next turn came in a median 17 s on the public agent traces;
    longer or after every answer lost there (docs/results/retention-agentic)."""
    turn_priority: int = DEFAULT_PRIORITY
    """After an end of turn: nothing by default (the user comes back minutes later, if at
    all: keeping the context loses more than it wins)."""
    turn_s: float = 600.0
    tool_tokens: tuple[int, ...] = ()
    """Token ids that start a tool call in the model's answers (``--session-tool-tokens``):
    with them the connector tells a tool call from an end of turn when the answer ends."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_sessions <= 10_000_000:
            raise ConfigError(f"--max-sessions: must be in [1, 10000000], got "
                              f"{self.max_sessions}")
        for option, value in (("--session-idle-s", self.idle_s),
                              ("--session-tool-s", self.tool_s),
                              ("--session-turn-s", self.turn_s)):
            if not 0 < value <= MAX_RETAIN_S:
                raise ConfigError(f"{option}: must be in (0, {MAX_RETAIN_S:g}] seconds, "
                                  f"got {value}")
        for option, priority in (("--session-tool-priority", self.tool_priority),
                                 ("--session-turn-priority", self.turn_priority)):
            if not 0 <= priority <= 100:
                raise ConfigError(f"{option}: must be an integer in [0, 100], got {priority}")
        check_tool_call_tokens(self.tool_tokens, "--session-tool-tokens")
        if not 1 <= self.prefix_messages <= 64:
            raise ConfigError(f"--session-prefix-messages: must be in [1, 64], got "
                              f"{self.prefix_messages}")
        if not self.end_header or not self.end_header.isascii() or " " in self.end_header:
            raise ConfigError(f"--session-end-header: expected a header name, got "
                              f"{self.end_header!r}")


@dataclass
class Session:
    last_seen: float
    last_finish: str | None = None


class Sessions:
    """The live sessions (an LRU table per tenant) and what their requests get."""

    def __init__(self, config: SessionConfig, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._metrics = metrics
        self._clock = clock
        self._tables: dict[str, OrderedDict[bytes, Session]] = {}
        """Each tenant's sessions, least recently seen first: one tenant's many sessions push
        out its own, never another's (tenants are the configured ones, so few)."""
        if config.retain and not config.tool_tokens and config.tool_priority > DEFAULT_PRIORITY:
            log.warning("--session-retention without --session-tool-tokens: the engine cannot "
                        "tell a tool call from an end of turn, so a session's retention "
                        "follows its previous answer (a guess that lost hits on the public "
                        "agent traces; docs/router-tenants.md, Sessions)")

    def __len__(self) -> int:
        return sum(map(len, self._tables.values()))

    # ------------------------------------------------------------------ requests

    def on_request(self, tenant: Tenant, header: str | None, end: str | None,
                   body: dict[str, Any] | None, endpoint: str) -> tuple[bytes | None, bool]:
        """The request's session (a digest, or None) and whether ``body`` was changed.
        Raises :class:`BadRequest` for a session header that breaks the rules."""
        key = self._identify(tenant, header, body, endpoint)
        if key is None:
            return None, False
        now = self._clock()
        self._expire(now)
        table = self._tables.setdefault(tenant.name, OrderedDict())
        if end is not None and end.strip().lower() in _TRUE:
            if table.pop(key, None) is not None:
                self._metrics.sessions_ended.labels("end").inc()
            self._metrics.sessions_live.set(len(self))
            return None, False
        session = table.pop(key, None) or Session(now)
        session.last_seen = now
        table[key] = session
        while len(table) > self.config.max_sessions:
            table.popitem(last=False)
            self._metrics.sessions_ended.labels("evicted").inc()
        self._metrics.sessions_live.set(len(self))
        changed = self.config.retain and body is not None and self._inject(tenant, session,
                                                                             body)
        return key, changed

    def on_answer(self, key: bytes | None, finish_reason: str | None) -> None:
        """The answer of a session's request ended with ``finish_reason``."""
        session = None
        if key is not None:
            for table in self._tables.values():
                if (session := table.get(key)) is not None:
                    break
        if session is not None and finish_reason is not None:
            session.last_finish = finish_reason

    def tick(self) -> None:
        """Forget idle sessions now (a /metrics scrape: the gauge is current)."""
        self._expire(self._clock())
        self._metrics.sessions_live.set(len(self))

    def _expire(self, now: float) -> None:
        """Forget sessions idle for --session-idle-s (each tenant's least recently seen
        first)."""
        for table in self._tables.values():
            while table:
                key, oldest = next(iter(table.items()))
                if now - oldest.last_seen < self.config.idle_s:
                    break
                del table[key]
                self._metrics.sessions_ended.labels("idle").inc()

    def _inject(self, tenant: Tenant, session: Session, body: dict[str, Any]) -> bool:
        params = body.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            return False  # the backend answers what it makes of it
        options = params.get("kvtier") if params is not None else None
        if options is not None and (not isinstance(options, dict)
                                    or any(k in options for k in CLIENT_KEYS)):
            self._metrics.session_retentions.labels("client").inc()
            return False
        cfg, cap = self.config, tenant.max_priority
        tool = _retain(cfg.tool_priority, cfg.tool_s, cap)
        turn = _retain(cfg.turn_priority, cfg.turn_s, cap)
        if cfg.tool_tokens:  # the connector tells the answer's kind when it ends
            finish: dict[str, Any] = {"stop": turn, "length": turn} if turn else {}
            if tool:
                finish.update(tool_calls=tool, tool_call_tokens=list(cfg.tool_tokens))
            if not finish:
                return self._nothing(cfg.tool_priority, cfg.turn_priority)
            self._options(body, options)["finish"] = finish
            stamp_tenant(body, tenant)
            self._metrics.session_retentions.labels("finish").inc()
            return True
        after_tool = session.last_finish == TOOL_CALLS
        retain = tool if after_tool else turn
        if retain is None:
            return self._nothing(cfg.tool_priority if after_tool else cfg.turn_priority)
        # the request's retention is set again when it ends (durations from then): no finish
        self._options(body, options)["retention"] = retain
        stamp_tenant(body, tenant)
        self._metrics.session_retentions.labels(TOOL_CALLS if after_tool else "turn").inc()
        return True

    def _nothing(self, *configured: int) -> bool:
        """No retention to set: the tenant's cap took it, or the configured one is none."""
        capped = any(p > DEFAULT_PRIORITY for p in configured)
        self._metrics.session_retentions.labels("capped" if capped else "none").inc()
        return False

    @staticmethod
    def _options(body: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
        """The body's ``kv_transfer_params.kvtier``, made only now if it had none (a body
        left alone is left as it came)."""
        if options is not None:
            return options
        params = body.setdefault("kv_transfer_params", {})
        made: dict[str, Any] = {}
        params["kvtier"] = made
        return made

    # ------------------------------------------------------------------ identity

    def _identify(self, tenant: Tenant, header: str | None, body: dict[str, Any] | None,
                  endpoint: str) -> bytes | None:
        if header is not None:
            return _digest(tenant.name, "header", check_session(header))
        user = body.get("user") if body is not None else None
        if isinstance(user, str) and 0 < len(user) <= MAX_USER_CHARS:
            return _digest(tenant.name, "user", user)
        opening = self._opening(body, endpoint)
        return None if opening is None else _digest(tenant.name, "prefix", opening)

    def _opening(self, body: dict[str, Any] | None, endpoint: str) -> str | None:
        """The conversation's first messages (chat) or its prompt's start (completions)."""
        if body is None:
            return None
        head: object
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            head = messages[:self.config.prefix_messages]
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str | list) or not prompt:
                return None
            head = prompt[:self.config.prefix_chars]
        try:
            return json.dumps(head, sort_keys=True)
        except (TypeError, ValueError, RecursionError):
            return None

    def check_integrity(self) -> None:
        for name, table in self._tables.items():
            assert len(table) <= self.config.max_sessions, name
            seen = [s.last_seen for s in table.values()]
            assert seen == sorted(seen), f"{name}'s table is not in order of last request"


def _retain(priority: int, duration_s: float, cap: int) -> dict[str, Any] | None:
    """A retention of ``priority`` (at most ``cap``) for ``duration_s``; None at or below
    the default (nothing to set)."""
    priority = min(priority, cap)
    return {"priority": priority, "duration_s": duration_s} \
        if priority > DEFAULT_PRIORITY else None


def check_session(value: str) -> str:
    """A session header's value, or :class:`BadRequest` naming what is allowed."""
    if not 0 < len(value) <= MAX_SESSION_CHARS or not value.isascii() \
            or not all(33 <= ord(c) <= 126 for c in value):
        raise BadRequest(f"session header: expected 1-{MAX_SESSION_CHARS} visible ASCII "
                         f"characters (no spaces), got {len(value)} characters")
    return value


def _digest(tenant: str, source: str, value: str) -> bytes:
    return hashlib.sha256(json.dumps([tenant, source, value]).encode()).digest()[:16]
