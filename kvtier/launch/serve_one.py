"""One ``kvtier serve`` instance: the node server in this process, vLLM as its child.

The terminal shows kvtier's summary — where vLLM's log is, the URL once it answers, the
tiers behind it — and vLLM's own output (and kvtier's log lines) go to the log file
(``--log-file``; ``-`` keeps them on the terminal). SIGINT/SIGTERM are passed on to vLLM;
when it exits, the server drains its writes and frees the arena.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING
from urllib.parse import urlsplit

from kvtier import logs
from kvtier.errors import ConfigError
from kvtier.httpjson import wait_models
from kvtier.launch.summary import say, tiers_line
from kvtier.ports import wait_bindable
from kvtier.processes import log_tail, spawn, stop_group

if TYPE_CHECKING:
    from kvtier.launch.plan import ServePlan

READY_TIMEOUT_S = 900.0
ORPHAN_GRACE_S = 5.0
"""After vLLM's API server exited on its own, how long what it left (its EngineCore and
workers) may take to go before SIGKILL."""
STOP_TIMEOUT_S = 45.0
"""Under what those who stop ``kvtier serve`` wait before they SIGKILL its own group (60 s in
a sweep, 90 s in a stack): vLLM's group is not theirs, so it must be gone by then."""


def serve_one(plan: ServePlan, demo: bool) -> int:
    log_file = _open_log(plan.log_file)
    logs.setup("info", "text", stream=log_file)
    try:
        _wait_ports(plan)
    except ConfigError as exc:
        say(f"kvtier serve: {exc}")
        if log_file is not None:
            log_file.close()
        return 1
    server = None
    if plan.server is not None:
        from kvtier.server import EmbeddedServer

        server = EmbeddedServer(plan.server)
        server.start()
    try:
        return _run_vllm(plan, demo, log_file, server.http_url if server else None)
    finally:
        if server is not None:
            server.stop()  # frees the arena however vLLM ended
        if log_file is not None:
            log_file.close()


def _wait_ports(plan: ServePlan) -> None:
    """The node server's and vLLM's ports, once bindable: after a restart a port in the
    ephemeral range may be held for up to a minute by a closed outgoing connection."""
    if plan.server is not None and plan.server.metrics_port:
        wait_bindable(plan.server.metrics_port, "the node server's HTTP API",
                      plan.server.metrics_host)
    where = urlsplit(plan.base_url)
    if where.port:  # on the address vLLM binds (loopback when it listens everywhere)
        wait_bindable(where.port, "vLLM's API server", where.hostname or "127.0.0.1")


def _open_log(path: Path | None) -> IO[str] | None:
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w", buffering=1)  # closed by serve_one


def _run_vllm(plan: ServePlan, demo: bool, log_file: IO[str] | None,
              node_url: str | None) -> int:
    from kvtier.launch.demo_request import DEV_MODE_ENV, demonstrate

    env = {**os.environ, **(DEV_MODE_ENV if demo else {})}
    # a session of its own: stopping it stops its group (the EngineCore with the API server)
    child = spawn(plan.cmd, out=log_file, env=env)
    stopping = _forward_signals(child)
    where = f"; its log: {plan.log_file}" if plan.log_file else ""
    say(f"kvtier serve: starting vLLM on {plan.model}{where}")
    started = time.monotonic()
    model = wait_models(plan.base_url, lambda: child.poll() is None and not stopping,
                        READY_TIMEOUT_S)
    if model is None:
        rc = _stop(child)
        if not stopping:
            say(f"kvtier serve: vLLM did not come up (exit status {rc})"
                + (f"; the end of {plan.log_file}:\n"
                   f"{textwrap.indent(log_tail(plan.log_file, 15), '    ')}"
                   if plan.log_file else ""))
            return 1
        return 0
    _say_up(plan, model, time.monotonic() - started, node_url)
    if demo:
        try:
            return demonstrate(plan.base_url, model)
        finally:
            _stop(child)
    say("  Ctrl-C stops it.")
    child.wait()
    # what it left behind in its group: on a Ctrl-C, time to stop in order; after a crash
    # (the API server died on its own) only a short grace, so a supervisor sees it soon
    rc = _stop(child) if stopping else stop_group(child, ORPHAN_GRACE_S)
    rc = rc if rc >= 0 else 128 - rc
    say(f"kvtier serve: vLLM exited (status {rc})")
    return rc


def _say_up(plan: ServePlan, model: str, took_s: float, node_url: str | None) -> None:
    say(f"kvtier serve: up in {took_s:.0f} s at {plan.base_url}/v1 (model {model!r})")
    if plan.server is not None:
        say(f"  tiers: {tiers_line(plan.server)}")
        if node_url is not None:
            auth = plan.server.auth
            token = auth.http_token_file or (os.environ.get(auth.http_token_env)
                                             and f"${auth.http_token_env}")
            say(f"  node server: {node_url} (/metrics, /v1/stats"
                + (f"; /v1/* need the bearer token in {token})" if token else ")"))
    else:
        say(f"  tiers: those of the kvtier server at {plan.socket_path}")


def _forward_signals(child: subprocess.Popen[bytes]) -> list[int]:
    """Pass SIGINT/SIGTERM on to vLLM; the returned list is non-empty once one came."""
    came: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        came.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return came


def _stop(child: subprocess.Popen[bytes]) -> int:
    """SIGTERM vLLM's API server (it stops its EngineCore), then its group: what is left
    of it, also when the API server has exited; SIGKILL after STOP_TIMEOUT_S."""
    return stop_group(child, STOP_TIMEOUT_S, leader_first=True)

