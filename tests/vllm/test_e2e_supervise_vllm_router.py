"""The stack outlives its parts behind vLLM's own router, with a local redis-server as the
shared tier (vLLM CPU build, float32).

One module-scoped ``kvtier serve --instances 2 --router vllm-router --shared-local redis``
(round_robin; the stack runs vllm-router with a 2 s health check that takes a worker out on
its first failure). Under the same bounded request loop as ``test_e2e_supervise.py``: kill -9
of a vLLM API server, of vllm-router, of redis-server. Requests keep succeeding, the only
failed ones were in flight at the kill, every answer equals the cold run, the part is back
within its bound, and the restarted instance loads a known prefix from the shared tier.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from stack_helpers import RunningStack, start_stack
from supervise_helpers import INSTANCE_BACK_S, api_server, cold_run, fault, parts, warm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.services, pytest.mark.faults]

ROUTER_BACK_S = 30.0
SERVICE_BACK_S = 30.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: str, vllm_router: str
          ) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("supervise-vllm-router")
    running = start_stack(root, "--router", "vllm-router", "--vllm-router", vllm_router,
                          "--shared-local", "redis")
    try:
        running.wait_up()
        yield running
    finally:
        rc = running.interrupt()
        assert rc == 0, running.output()[-2000:]


@pytest.fixture(scope="module")
def cold(stack: RunningStack) -> dict[str, Any]:
    return cold_run(stack, prompts=4, probes=1)


def test_kill_9_of_a_vllm_api_server_behind_vllm_router(
        stack: RunningStack, cold: dict[str, Any]) -> None:
    victim = api_server(int(stack.state()["instances"][1]["pid"]))
    fault(stack, cold, "instance 1", victim, signal.SIGKILL, INSTANCE_BACK_S)
    warm(stack, cold, 1, 0)


def test_kill_9_of_vllm_router(stack: RunningStack, cold: dict[str, Any]) -> None:
    router = int(stack.state()["router"]["pid"])
    fault(stack, cold, "router (vllm-router)", router, signal.SIGKILL, ROUTER_BACK_S)
    assert "router (vllm-router) exited (status 137); restarting it in 1 s" in stack.output()


def test_kill_9_of_redis_server(stack: RunningStack, cold: dict[str, Any]) -> None:
    redis = int(parts(stack)["redis"]["pid"])
    fault(stack, cold, "redis", redis, signal.SIGKILL, SERVICE_BACK_S)
    assert "redis exited (status 137); restarting it in 1 s" in stack.output()
