"""``kvtier verify`` fails, naming the step, on a stack whose shared tier is off.

``kvtier serve --instances 2 --shared none --router none --verify``: two instances that share
nothing and no router (verify goes to the first instance, as a client would); verify runs
once the stack is up, and the stack stops with its exit status. The long prefix is served,
but no chunk reaches a shared tier (step 3), and no other instance serves it (step 5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from stack_helpers import start_stack

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_verify_fails_naming_the_step_when_the_shared_tier_is_off(
        tmp_path: Path, demo_model: str) -> None:
    stack = start_stack(tmp_path, "--router", "none", "--shared", "none", "--verify")
    try:
        rc = stack.proc.wait(timeout=900)
    finally:
        stack.interrupt()
    out = stack.output()
    print(out)
    assert rc == 1, out
    assert "[1/5] entry point      ok" in out and "[2/5] long prefix      ok" in out
    assert "[3/5] shared tier      FAIL no kvtier server has a shared tier" in out
    assert "[5/5] another instance FAIL" in out
    assert "kvtier verify: FAILED step 3 (shared tier)" in out
    assert "no router: call the instances directly" in out
    assert "(no shared tier)" in out and out.rstrip().endswith("kvtier serve: stopped")
