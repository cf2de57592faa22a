"""Supervision of the stack's parts: what exits or stops answering is restarted alone.

One :class:`Supervised` record per part (an instance, the router, a local service) follows it
through these states::

    starting ──answers──► up ──exits, or N probes unanswered──► restarting ──backoff──► starting
       │  (exits, or no answer after start_timeout_s)               │
       └────────────────────────────────────────────────────────────┤ more than `limit`
                                                                    ▼ restarts in `window_s`
                                                                 given up

Before a part is started again, everything it left is killed (:meth:`Part.kill`: its process
groups, also those whose leader already died) so the new one finds its ports free. Backoff
doubles from ``backoff_s`` with each restart in the window, up to ``backoff_max_s``. Each change
is one line through ``say``; ``on_change`` is called after it (the stack rewrites stack.json and
the status line). With ``restart_on_failure=False`` a failed part goes straight to given up.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class PartState(enum.Enum):
    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    GIVEN_UP = "given up"


@dataclass(frozen=True)
class RestartPolicy:
    restart_on_failure: bool = True
    limit: int = 5
    """Restarts allowed within ``window_s``; one more failure and the part is given up."""
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    probe_every_s: float = 2.0
    unanswered: int = 3
    """Probes in a row a part that is up may leave unanswered before it counts as hung."""
    start_timeout_s: float = 900.0

    def backoff(self, recent: int) -> float:
        """The wait before restart number ``recent`` (1-based) of the window."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, recent - 1))


class Part(Protocol):
    """What the supervisor needs of a part; :mod:`kvtier.launch.parts` has the kinds."""

    name: str

    def launch(self) -> None:
        """Start it (a process: returns at once; the probe tells when it is up)."""

    def running(self) -> bool: ...

    def answers(self) -> bool:
        """One probe, bounded by a timeout of about a second or two."""

    def exit_status(self) -> int | None: ...

    def observe(self) -> None:
        """Called while it runs: note what it started (process groups to kill later)."""

    def kill(self) -> None:
        """SIGKILL all of it, and wait (bounded) until it is gone."""

    def stop(self, timeout_s: float) -> None:
        """Stop it in order (SIGTERM, then SIGKILL after ``timeout_s``)."""

    @property
    def pid(self) -> int | None: ...

    @property
    def log(self) -> Path | None: ...

    def tail(self, lines: int = 15) -> str: ...


@dataclass
class Supervised:
    part: Part
    state: PartState = PartState.STARTING
    since: float = field(default_factory=time.monotonic)
    restarts: int = 0
    """Restarts since the stack started."""
    recent: list[float] = field(default_factory=list)
    """When each restart within the window was decided."""
    unanswered: int = 0
    next_probe: float = 0.0
    restart_at: float = 0.0
    reason: str = ""
    """Why it last failed ("" if it never did)."""
    ever_up: bool = False

    @property
    def name(self) -> str:
        return self.part.name

    def summary(self) -> str:
        text = self.state.value
        if self.restarts:
            text += f" ({self.restarts} restart{'s' if self.restarts != 1 else ''})"
        return f"{self.name} {text}"

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "restarts": self.restarts, "pid": self.part.pid,
                "reason": self.reason or None,
                "log": str(self.part.log) if self.part.log else None}


class Supervisor:
    def __init__(self, policy: RestartPolicy, say: Callable[[str], None],
                 on_change: Callable[[Supervised], None] | None = None) -> None:
        self.policy = policy
        self.say = say
        self.on_change = on_change
        self.parts: dict[str, Supervised] = {}
        self._probes = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvtier-probe")

    def __iter__(self) -> Iterator[Supervised]:
        return iter(list(self.parts.values()))

    def __getitem__(self, name: str) -> Supervised:
        return self.parts[name]

    def add(self, part: Part, *, launched: bool = False, up: bool = False) -> Supervised:
        """Supervise ``part``; launch it unless ``launched`` (``up``: it already answers)."""
        if not launched:
            part.launch()
        record = Supervised(part)
        if up:
            record.state, record.ever_up = PartState.UP, True
        self.parts[part.name] = record
        return record

    def in_state(self, *states: PartState) -> list[Supervised]:
        return [r for r in self.parts.values() if r.state in states]

    def close(self) -> None:
        self._probes.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one round

    def tick(self, now: float | None = None) -> None:
        """Look at every part once: probe those due, start those whose backoff is over."""
        now = time.monotonic() if now is None else now
        due = [r for r in self.parts.values()
               if r.state in (PartState.STARTING, PartState.UP) and now >= r.next_probe]
        answers = dict(zip([r.name for r in due], self._probe([r.part for r in due]),
                           strict=True))
        for record in list(self.parts.values()):
            if record.state is PartState.RESTARTING and now >= record.restart_at:
                self._relaunch(record, now)
            elif record.state in (PartState.STARTING, PartState.UP):
                self._look(record, answers.get(record.name), now)

    def _probe(self, parts: list[Part]) -> list[bool | None]:
        def one(part: Part) -> bool | None:
            if not part.running():
                return None
            part.observe()
            return part.answers()

        return list(self._probes.map(one, parts))

    def _look(self, r: Supervised, answered: bool | None, now: float) -> None:
        if not r.part.running():
            when = "while starting" if r.state is PartState.STARTING else ""
            self.failed(r, f"exited (status {_status(r.part.exit_status())}) {when}".strip(),
                        now)
            return
        if answered is None:
            return  # not probed this round
        r.next_probe = now + (0.5 if r.state is PartState.STARTING else self.policy.probe_every_s)
        if r.state is PartState.STARTING:
            if answered:
                again = f" again after restart {r.restarts}" if r.ever_up or r.restarts else ""
                self._change(r, PartState.UP, f"{r.name} up{again} "
                             f"(in {now - r.since:.0f} s)", now)
                r.ever_up, r.unanswered = True, 0
            elif now - r.since > self.policy.start_timeout_s:
                self.failed(r, f"not answering {self.policy.start_timeout_s:.0f} s after "
                            "its start", now)
            return
        r.unanswered = 0 if answered else r.unanswered + 1
        if r.unanswered >= self.policy.unanswered:
            self.failed(r, f"stopped answering ({r.unanswered} probes in a row)", now)

    def failed(self, r: Supervised, reason: str, now: float | None = None) -> None:
        """``r`` exited or hangs: kill what is left of it, then restart it or give up."""
        now = time.monotonic() if now is None else now
        r.part.kill()
        r.reason, r.unanswered = reason, 0
        r.recent = [t for t in r.recent if now - t < self.policy.window_s]
        where = f"; its log: {r.part.log}" if r.part.log else ""
        if not self.policy.restart_on_failure or len(r.recent) >= self.policy.limit:
            why = ("--restart never" if not self.policy.restart_on_failure else
                   f"giving up on it after {len(r.recent)} restart(s) within "
                   f"{self.policy.window_s:.0f} s")
            tail = r.part.tail()
            self._change(r, PartState.GIVEN_UP, f"{r.name} {reason}; {why}{where}"
                         + (f"; the end of it:\n{_indent(tail)}" if tail else ""), now)
            return
        r.recent.append(now)
        wait = self.policy.backoff(len(r.recent))
        r.restart_at = now + wait
        self._change(r, PartState.RESTARTING,
                     f"{r.name} {reason}; restarting it in {wait:.0f} s (restart "
                     f"{len(r.recent)} of {self.policy.limit} within "
                     f"{self.policy.window_s:.0f} s){where}", now)

    def _relaunch(self, r: Supervised, now: float) -> None:
        r.restarts += 1
        r.next_probe = now + 0.5
        try:
            r.part.launch()
        except Exception as exc:  # a start that raises is a failed start
            r.state = PartState.STARTING
            self.failed(r, f"failed to start: {type(exc).__name__}: {exc}", now)
            return
        self._change(r, PartState.STARTING, f"{r.name} starting (restart {r.restarts})", now)

    def _change(self, r: Supervised, state: PartState, line: str, now: float) -> None:
        r.state, r.since = state, now
        self.say(f"kvtier serve: {line}")
        if self.on_change is not None:
            self.on_change(r)


def _status(rc: int | None) -> str:
    if rc is None:
        return "unknown"
    return str(128 - rc) if rc < 0 else str(rc)  # killed by signal n: 128 + n, as a shell


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())
