"""Two nodes, one shared tier (vLLM CPU build, float32, greedy).

Each "node" is a kvtier server of its own (own arena, no disk tier) with one vLLM engine on
it; the servers share only the lower tier: a folder, a SeaweedFS FUSE volume (two mounts of
one filer, as two NFS clients), SeaweedFS S3, Redis. Engine A answers a set of prompts (and
stores them); engine B's first request for the same prompts is served from the shared tier,
with the tokens of a run without any cache, and its ``kv_transfer_params`` says so.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import e2e
import pytest
from e2e import ServerProcess, adds_up, tier_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.services]
SHARING = {"journal_interval_s": 0.1, "poll_s": 0.2, "sweep_interval_s": 600}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ...]]:
    root = tmp_path_factory.mktemp("kvtier-nodes")
    shared = root / "shared"
    made = tuple(ServerProcess(root / name, arena_bytes=64 << 20,
                               tiers=[fs_tier(shared)]).start() for name in ("a", "b"))
    yield made
    for node in made:
        node.stop()


@pytest.fixture(scope="module")
def engines(demo_model: str, nodes: tuple[ServerProcess, ...]) -> Iterator[tuple[Any, Any]]:
    a = e2e.make_llm(demo_model, nodes[0].socket_path)
    b = e2e.make_llm(demo_model, nodes[1].socket_path)
    yield a, b
    e2e.close_llm(a)
    e2e.close_llm(b)


def fs_tier(path: Path) -> dict[str, Any]:
    return {"type": "fs", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 2,
            "options": {"path": str(path), **SHARING}}


def shared_tier(backend: str, request: pytest.FixtureRequest, tmp_path: Path
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shared tier as each node configures it (the FUSE volume: one mount per node)."""
    if backend == "fs":
        tier = fs_tier(tmp_path / "shared")
        return tier, tier
    if backend == "fuse":
        make_mount = request.getfixturevalue("make_seaweed_mount")
        return (fs_tier(Path(make_mount().path) / "kvtier"),
                fs_tier(Path(make_mount().path) / "kvtier"))
    if backend == "s3":
        from tiers.s3_helpers import key_file

        bucket = request.getfixturevalue("s3_bucket")
        keys = key_file(tmp_path / "keys", bucket.credentials)
        tier = {"type": "s3", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 4,
                "options": {"bucket": bucket.name, "endpoint_url": bucket.endpoint,
                            "tls": False, "credentials": f"file:{keys}", **SHARING}}
        return tier, tier
    if backend == "redis":
        server = request.getfixturevalue("redis_server")
        tier = {"type": "redis", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 4,
                "options": {"url": server.url, **SHARING}}
        return tier, tier
    pytest.fail(f"backend {backend} is not wired yet")


def chunks_on(node: ServerProcess, tier: str = "shared") -> int:
    return int(node.stats()["tiers"][tier]["chunks"])


@pytest.mark.parametrize("backend", ["fs", "fuse", "s3", "redis"])
def test_b_loads_from_the_shared_tier_what_a_stored(
        backend: str, nodes: tuple[ServerProcess, ...], engines: tuple[Any, Any],
        baseline: dict[str, Any], request: pytest.FixtureRequest, tmp_path: Path) -> None:
    a_node, b_node = nodes
    a_tier, b_tier = shared_tier(backend, request, tmp_path)
    a_node.restart(tiers=[a_tier])
    b_node.restart(tiers=[b_tier])
    prompts = e2e.CROSS[backend]
    want = sum(len(p) // 256 for p in prompts)
    stored = e2e.generate(engines[0], prompts)
    assert stored.tokens == baseline[f"CROSS_{backend}"]
    deadline = time.monotonic() + 30
    while chunks_on(b_node) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert chunks_on(b_node) == want, "node B's books follow A's journal"
    result = e2e.one_by_one(engines[1], prompts)
    assert result.tokens == baseline[f"CROSS_{backend}"], "tokens of a run without cache"
    for acct, prompt in zip(result.kvtier, prompts, strict=True):
        assert tier_tokens(acct, "shared") == len(prompt) // 256 * 256, acct
        assert adds_up(acct, prompt)
