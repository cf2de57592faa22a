"""``kvtier serve --instances 2 --router vllm-router`` end to end (vLLM CPU build, float32).

The stack on one machine: two instances, each with its own node server (socket, arena,
HTTP API) and bound to a core of its own, one shared folder, vLLM's Rust router in front
(round_robin). Through the router, a long prompt lands on one instance and, sent again, on
the other, which loads it from the shared tier (``kv_transfer_params``, vLLM's
``cached_tokens``) with the same tokens. ``kvtier verify --stack`` passes on it. One Ctrl-C
stops everything: no process of the stack is left, the arenas are freed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from stack_helpers import RunningStack, start_stack

from kvtier.httpjson import get_json, get_text, post_json
from kvtier.launch.summary import size
from kvtier.processes import group_members

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: str, vllm_router: str
          ) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("stack")
    running = start_stack(root, "--router", "vllm-router", "--vllm-router", vllm_router,
                          "--shared", str(root / "shared"))
    try:
        running.wait_up()
        yield running
    finally:
        running.interrupt()


def _requests(url: str) -> float:
    text = get_text(f"{url}/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _complete(stack: RunningStack, prompt: str) -> dict[str, Any]:
    body = {"model": "kvtier-demo", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    return dict(post_json(f"{stack.url}/v1/completions", body))


def _shared_chunks(node: str) -> int:
    return int(get_json(f"{node}/v1/stats")["tiers"]["shared"]["chunks"])


def test_the_terminal_shows_a_short_status_and_the_engines_log_to_files(
        stack: RunningStack) -> None:
    out = stack.output()
    lines = out.strip().splitlines()
    assert len(lines) <= 16, out
    assert f"vllm-router (round_robin) at http://127.0.0.1:{stack.port}/v1" in out
    for i in range(2):
        assert re.search(rf"instance {i}  http://127\.0\.0\.1:{stack.port + 1 + i}/v1  "
                         rf"node server http://127\.0\.0\.1:{stack.port + 101 + i}", out), out
    assert f"arena {size(256 << 20)} (host RAM) -> fs 'shared' 8 GiB in" in out
    assert "INFO" not in out and "Traceback" not in out, "engine logs belong in files"
    for instance in stack.state()["instances"]:
        log = Path(instance["log"]).read_text(errors="replace")
        assert "vllm" in log.lower() and "kvtier serve: up" in log


def test_a_prompt_sent_twice_is_served_by_the_other_instance_from_the_shared_tier(
        stack: RunningStack) -> None:
    from kvtier.demo.model import corpus_text

    instances = stack.state()["instances"]
    urls = [i["url"] for i in instances]
    prompt = f"stack test {uuid.uuid4().hex}\n{corpus_text()}"
    before = [_requests(u) for u in urls]
    shared_before = [_shared_chunks(i["node"]) for i in instances]
    first = _complete(stack, prompt)
    mid = [_requests(u) for u in urls]
    home = [i for i in range(2) if mid[i] > before[i]]
    assert len(home) == 1, (before, mid)
    other = 1 - home[0]
    chunks = first["usage"]["prompt_tokens"] // 256
    assert first["kv_transfer_params"]["kvtier"]["stored_chunks"] == chunks
    deadline = time.monotonic() + 30
    while _shared_chunks(instances[other]["node"]) < shared_before[other] + chunks:
        assert time.monotonic() < deadline, "the other node never saw the shared chunks"
        time.sleep(0.2)
    second = _complete(stack, prompt)
    after = [_requests(u) for u in urls]
    assert after[other] > mid[other] and after[home[0]] == mid[home[0]], \
        "round_robin sends the second request to the other instance"
    tokens = second["kv_transfer_params"]["kvtier"]["tokens"]
    assert tokens.get("shared") == chunks * 256, tokens
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == chunks * 256
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_kvtier_verify_passes_on_the_stack(stack: RunningStack) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier", "verify", "--stack", str(stack.run_dir / "stack.json")],
        capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in range(1, 6):
        assert re.search(rf"^\[{step}/5\] .* ok ", result.stdout, re.M), result.stdout
    assert "all 5 steps passed" in result.stdout


def test_one_ctrl_c_stops_everything(stack: RunningStack) -> None:
    state = stack.state()
    pids = [i["pid"] for i in state["instances"]] + [state["router"]["pid"]]
    arenas = [m.group(1) for i in state["instances"]
              for m in [re.search(r"arena (kvtier-[A-Za-z0-9_.-]+)",
                                  Path(i["log"]).read_text(errors="replace"))] if m]
    assert len(arenas) == 2 and all(Path("/dev/shm", a).exists() for a in arenas)
    assert stack.interrupt() == 0
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{pid} outlived Ctrl-C"
        assert group_members(pid) == [], f"processes left in group {pid}"
    assert not any(Path("/dev/shm", a).exists() for a in arenas), "an arena was not freed"
    assert "stopping 2 instance(s)" in stack.output()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
