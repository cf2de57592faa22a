"""The stack outlives its parts (vLLM CPU build, float32; SeaweedFS on loopback).

One module-scoped ``kvtier serve --instances 2 --shared-local s3`` behind ``kvtier route``
(roundrobin, so both instances serve), ``--restart-limit 2``. Under a bounded request loop
through the endpoint (two clients, whole answers), each test kills one part:

- kill -9 of instance 0's vLLM API server, of instance 1's EngineCore, of instance 0's
  ``kvtier serve`` (its node server), of the router; SIGSTOP of SeaweedFS (then SIGCONT);
- requests keep succeeding through the endpoint; the only failed ones were in flight on the
  killed part at the kill (each listed in the output); a connection refused while the router
  itself restarts is re-sent by the client (nothing was sent);
- the text of every completed request equals the cold run's (the first request of each prompt,
  computed from scratch before any fault);
- the part is back ("up" in stack.json) within its documented time, and a restarted
  instance's first request for a known prefix is served from the shared tier (its arena is
  new, its node server's books of the shared tier rebuilt).

Then a part that fails on every start (instance 1, its node-server port taken by another
program) is given up after the bound while instance 0 serves; the router's /metrics shows it;
Ctrl-C stops the stack with exit status 3 and a last line naming it.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from stack_helpers import RunningStack, start_stack
from supervise_helpers import (
    INSTANCE_BACK_S,
    Loop,
    all_up,
    api_server,
    cold_run,
    engine_core,
    fault,
    parts,
    report,
    wait_part,
    warm,
)

from kvtier.httpjson import get_text
from kvtier.processes import alive

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.services, pytest.mark.faults]

ROUTER_BACK_S = 30.0
SERVICE_BACK_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: str) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("supervise")
    running = start_stack(root, "--router", "kvtier", "--router-policy", "roundrobin",
                          "--shared-local", "s3", "--restart-limit", "2")
    try:
        running.wait_up()
        yield running
    finally:
        running.interrupt()


@pytest.fixture(scope="module")
def cold(stack: RunningStack) -> dict[str, Any]:
    return cold_run(stack, prompts=4, probes=3)


def _pid(stack: RunningStack, i: int) -> int:
    return int(stack.state()["instances"][i]["pid"])


def test_the_status_shows_every_part(stack: RunningStack) -> None:
    out = stack.output()
    assert "parts: seaweedfs up · instance 0 up · instance 1 up · router (kvtier) up" in out, out
    assert "restarted on failure, at most 2 times in 600 s" in out
    state = stack.state()
    assert state["restart"] == {"mode": "on-failure", "limit": 2, "window_s": 600.0}
    assert {p["state"] for p in state["parts"].values()} == {"up"}


def test_kvtier_verify_passes_from_the_router_url_alone(stack: RunningStack) -> None:
    """No --stack, no --kvtier-servers: the router says who is behind it."""
    result = subprocess.run([sys.executable, "-m", "kvtier", "verify", "--url", stack.url],
                            capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the router lists 2 instance(s) and their node servers" in result.stdout
    assert "all 5 steps passed" in result.stdout


def test_kill_9_of_a_vllm_api_server(stack: RunningStack, cold: dict[str, Any]) -> None:
    victim = api_server(_pid(stack, 0))
    fault(stack, cold, "instance 0", victim, signal.SIGKILL, INSTANCE_BACK_S)
    out = stack.output()
    assert re.search(r"instance 0 (exited \(status 137\)|stopped answering \(3 probes in a "
                     r"row\)); restarting it in 1 s \(restart 1 of 2 within 600 s\)", out), out
    warm(stack, cold, 0, 0)


def test_kill_9_of_an_engine_core(stack: RunningStack, cold: dict[str, Any]) -> None:
    victim = engine_core(_pid(stack, 1))
    fault(stack, cold, "instance 1", victim, signal.SIGKILL, INSTANCE_BACK_S)
    warm(stack, cold, 1, 1)


def test_kill_9_of_a_node_server(stack: RunningStack, cold: dict[str, Any]) -> None:
    serve = _pid(stack, 0)  # kvtier serve hosts the node server
    vllm = api_server(serve)
    fault(stack, cold, "instance 0", serve, signal.SIGKILL, INSTANCE_BACK_S)
    assert not alive(vllm), "the old vLLM was stopped with its node server"
    warm(stack, cold, 0, 2)


def test_kill_9_of_the_router(stack: RunningStack, cold: dict[str, Any]) -> None:
    router = int(stack.state()["router"]["pid"])
    fault(stack, cold, "router (kvtier)", router, signal.SIGKILL, ROUTER_BACK_S)
    assert stack.state()["router"]["pid"] != router
    metrics = get_text(f"{stack.url}/metrics")
    assert 'kvtier_stack_part_restarts_total{part="router (kvtier)"} 1.0' in metrics
    assert 'kvtier_stack_part_restarts_total{part="instance 0"} 2.0' in metrics


def test_sigstop_of_seaweedfs(stack: RunningStack, cold: dict[str, Any]) -> None:
    weed = int(parts(stack)["seaweedfs"]["pid"])
    try:
        fault(stack, cold, "seaweedfs", weed, signal.SIGSTOP, SERVICE_BACK_S)
    finally:
        if alive(weed):
            os.kill(weed, signal.SIGCONT)
    assert "seaweedfs stopped answering (3 probes in a row)" in stack.output()
    assert not alive(weed), "the hung one was killed before its restart"


def test_a_part_failing_on_every_start_is_given_up_and_named_at_the_end(
        stack: RunningStack, cold: dict[str, Any]) -> None:
    all_up(stack)
    node_port = stack.port + 102
    serve = _pid(stack, 1)
    loop = Loop(stack.url, cold["prompts"]).start()
    squat = socket.socket()  # SO_REUSEADDR: the port has connections in TIME_WAIT
    squat.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        os.kill(serve, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # another program takes instance 1's node-server port
            try:
                squat.bind(("127.0.0.1", node_port))
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        squat.listen(1)
        wait_part(stack, "instance 1", "given up", timeout_s=120)
        given = time.monotonic()
        while loop.ok_since(given) < 4:
            assert time.monotonic() - given < 60, "instance 0 does not serve"
            time.sleep(0.1)
    finally:
        sent = loop.stop()
    failed = report("instance 1 given up", sent, 0.0)
    assert len(failed) <= loop.clients
    assert all(s.text == cold["texts"][cold["prompts"][s.prompt]] for s in sent if s.ok)
    metrics = get_text(f"{stack.url}/metrics")
    assert 'kvtier_stack_part_state{part="instance 1",state="given up"} 1.0' in metrics
    out = stack.output()
    assert "instance 1 exited (status 1) while starting; giving up on it after 2 restart(s)" \
        in out, out[-3000:]
    assert ("parts: seaweedfs up (1 restart) · instance 0 up (2 restarts) · instance 1 given "
            "up (2 restarts)") in out
    rc = stack.interrupt()
    squat.close()
    last = stack.output().strip().splitlines()[-1]
    assert rc == 3, stack.output()[-2000:]
    assert last.startswith("kvtier serve: stopped; gave up on instance 1 (exited (status 1)")
