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
    # Always load: whether the shared tier's read beats this engine's recompute depends on the
    # machine's load (tests/vllm/test_load_or_recompute.py covers that choice); here every
    # planned hit must be a load, so the accounting is exact.
    a = e2e.make_llm(demo_model, nodes[0].socket_path, load_or_recompute=False)
    b = e2e.make_llm(demo_model, nodes[1].socket_path, load_or_recompute=False)
    yield a, b
    e2e.close_llm(a)
    e2e.close_llm(b)


def fs_tier(path: Path, **options: Any) -> dict[str, Any]:
    return {"type": "fs", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 2,
            "options": {"path": str(path), **SHARING, **options}}


def shared_tier(backend: str, request: pytest.FixtureRequest, tmp_path: Path
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shared tier as each node configures it (the FUSE volume: one mount per node)."""
    if backend == "fs":
        tier = fs_tier(tmp_path / "shared")
        return tier, tier
    if backend == "fuse":
        # Mounted at two paths: one tier_id tells both that it is one tier (docs/shared.md).
        make_mount = request.getfixturevalue("make_seaweed_mount")
        return (fs_tier(Path(make_mount().path) / "kvtier", tier_id="e2e-fuse"),
                fs_tier(Path(make_mount().path) / "kvtier", tier_id="e2e-fuse"))
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


def signed(path: Path) -> bool:
    from kvtier.codec import FLAG_MAC, USED_HEADER_BYTES, ChunkHeader

    with open(path, "rb") as f:
        return bool(ChunkHeader.unpack(f.read(USED_HEADER_BYTES)).flags & FLAG_MAC)


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
    if backend == "fs":
        assert all(signed(path) for path in Path(a_tier["options"]["path"]).rglob("*.kvc")), \
            "every chunk on the shared tier carries the cluster secret's MAC"
    result = e2e.one_by_one(engines[1], prompts)
    assert result.tokens == baseline[f"CROSS_{backend}"], "tokens of a run without cache"
    for acct, prompt in zip(result.kvtier, prompts, strict=True):
        assert tier_tokens(acct, "shared") == len(prompt) // 256 * 256, acct
        assert adds_up(acct, prompt)


# ---------------------------------------------------------------------- faults

FAULTY = {"breaker": {"errors": 3, "error_ratio": 0.0, "cooldown_s": 1.0},
          "io_timeout_s": 5.0}
"""Opens on 3 failures: an outage fails every call at once; a restarted SeaweedFS on a
machine both engines keep busy may still be slow on one or two."""


def wait_for(check: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def breaker(node: ServerProcess) -> str:
    return str(node.stats()["tiers"]["shared"]["breaker"])


def test_s3_stopped_mid_run_is_bypassed_and_comes_back(
        nodes: tuple[ServerProcess, ...], engines: tuple[Any, Any], baseline: dict[str, Any],
        make_seaweedfs: Any, tmp_path: Path) -> None:
    from tiers.s3_helpers import key_file

    weed = make_seaweedfs()
    keys = key_file(tmp_path / "keys", weed.credentials)
    tier = {"type": "s3", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 4,
            **FAULTY, "options": {"bucket": "outage", "endpoint_url": weed.endpoint,
                                  "tls": False, "credentials": f"file:{keys}",
                                  "create_bucket": True, "connect_timeout_s": 1.0,
                                  "read_timeout_s": 3.0, "retries": 0, **SHARING}}
    for node in nodes:
        node.restart(tiers=[tier])
    a, b = engines
    before = e2e.CROSS["before_outage"]
    assert e2e.generate(a, before).tokens == baseline["CROSS_before_outage"]
    assert wait_for(lambda: chunks_on(nodes[1]) == sum(len(p) // 256 for p in before))
    weed.stop()
    during = e2e.CROSS["during_outage"]
    assert e2e.generate(a, during).tokens == baseline["CROSS_during_outage"], "A serves on"
    served = e2e.one_by_one(b, before)  # B planned shared hits: the loads fail, recompute
    assert served.tokens == baseline["CROSS_before_outage"], "B serves on, correctly"
    assert wait_for(lambda: breaker(nodes[0]) == "open" and breaker(nodes[1]) == "open")
    weed.start()
    assert wait_for(lambda: breaker(nodes[0]) == "closed" and breaker(nodes[1]) == "closed")
    after = e2e.CROSS["after_outage"]
    assert e2e.generate(a, after).tokens == baseline["CROSS_after_outage"]
    want = sum(len(p) // 256 for p in before + after)
    assert wait_for(lambda: chunks_on(nodes[1]) >= want), "A's journal reached B again"
    result = e2e.one_by_one(b, after)
    assert result.tokens == baseline["CROSS_after_outage"]
    assert all(tier_tokens(acct, "shared") == len(p) // 256 * 256
               for acct, p in zip(result.kvtier, after, strict=True)), result.kvtier


def test_a_corrupt_shared_object_is_a_miss_removed_and_counted(
        nodes: tuple[ServerProcess, ...], engines: tuple[Any, Any], baseline: dict[str, Any],
        tmp_path: Path) -> None:
    from kvtier import codec
    from kvtier.keys import ChunkKey

    tier = fs_tier(tmp_path / "shared")
    for node in nodes:
        node.restart(tiers=[tier])
    prompts = e2e.CROSS["corrupt"]
    assert e2e.generate(engines[0], prompts).tokens == baseline["CROSS_corrupt"]
    assert wait_for(lambda: chunks_on(nodes[1]) == sum(len(p) // 256 for p in prompts))
    victim = sorted((tmp_path / "shared" / "chunks").rglob("*.kvc"))[0]
    with open(victim, "r+b") as f:
        f.seek(8192)
        f.write(b"\x5a" * 64)
    result = e2e.one_by_one(engines[1], prompts)
    assert result.tokens == baseline["CROSS_corrupt"], "never a wrong block"
    assert nodes[1].stats()["tiers"]["shared"]["checksum_failures"] == 1
    assert sum(int(acct.get("failed_load_tokens", 0)) for acct in result.kvtier) > 0
    # Removed, then written again whole by B, which recomputed it and stored it.
    assert wait_for(lambda: victim.exists())
    key = ChunkKey(bytes.fromhex(victim.name.removesuffix(".kvc")))
    codec.verify(memoryview(victim.read_bytes()), key)


def test_a_writer_killed_mid_upload_leaves_no_partial_chunk_served(
        nodes: tuple[ServerProcess, ...], engines: tuple[Any, Any], baseline: dict[str, Any],
        s3_bucket: Any, tmp_path: Path) -> None:
    from tiers.s3_helpers import key_file

    from kvtier import codec
    from kvtier.errors import CorruptChunkError
    from kvtier.keys import ChunkKey

    keys = key_file(tmp_path / "keys", s3_bucket.credentials)
    tier = {"type": "s3", "name": "shared", "capacity_bytes": 1 << 30, "io_threads": 1,
            "options": {"bucket": s3_bucket.name, "endpoint_url": s3_bucket.endpoint,
                        "tls": False, "credentials": f"file:{keys}", **SHARING}}
    for node in nodes:
        node.restart(tiers=[tier])
    prompts = e2e.CROSS["killed"]
    assert e2e.generate(engines[0], prompts).tokens == baseline["CROSS_killed"]
    nodes[0].kill()  # uploads still queued or in flight
    client = s3_bucket.client()
    whole: list[int] = []
    cut: list[int] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket.name,
                                                                  Prefix="kvtier/chunks/"):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=s3_bucket.name, Key=obj["Key"])["Body"].read()
            key = ChunkKey(bytes.fromhex(obj["Key"].rsplit("/", 1)[1].removesuffix(".kvc")))
            try:
                codec.verify(memoryview(body), key)
                whole.append(len(body))
            except CorruptChunkError:
                cut.append(len(body))
    # AWS S3 keeps nothing of a PUT whose writer died; SeaweedFS may keep the body it got
    # (seen: an empty object). Such an object is only ever cut short, never altered, and
    # verification refuses it like any corrupt one (the reader then recomputes, below)
    assert all(size < min(whole, default=1 << 30) for size in cut), (cut, whole)
    result = e2e.one_by_one(engines[1], prompts)
    assert result.tokens == baseline["CROSS_killed"]
    nodes[0].start(tiers=[tier])


def test_two_writers_keep_the_shared_volume_within_its_budget(
        nodes: tuple[ServerProcess, ...], engines: tuple[Any, Any], baseline: dict[str, Any],
        tmp_path: Path) -> None:
    chunk = 4096 + (1 << 20)  # what one chunk file takes (demo model: 1 MiB payload)
    budget = 12 * chunk
    tier = {**fs_tier(tmp_path / "shared", sweep_interval_s=1.0), "capacity_bytes": budget}
    for node in nodes:
        node.restart(tiers=[tier])
    for engine, case in ((engines[0], "budget_a"), (engines[1], "budget_b")):
        assert e2e.generate(engine, e2e.CROSS[case]).tokens == baseline[f"CROSS_{case}"]
    files = list((tmp_path / "shared" / "chunks").rglob("*.kvc"))
    written = sum(len(p) // 256 for c in ("budget_a", "budget_b") for p in e2e.CROSS[c])
    assert written > 12, "the two wrote more than the budget holds"
    # The documented bound: each writer keeps to the budget the chunks it wrote, read or
    # listed (room from a peer's bookings only forgets them), and the sweeper brings the whole
    # tier back within it (docs/shared.md).
    assert wait_for(lambda: sum(f.stat().st_size for f in
                                (tmp_path / "shared" / "chunks").rglob("*.kvc")) <= budget,
                    timeout_s=60)
    assert len(files) <= written
