"""The cache strategy weighs affinity against load: with a shared tier every instance can
load a prefix, so a burst of requests sharing one spreads over both; with node-local tiers
only, the instance holding it keeps them (recomputing elsewhere costs more than queueing).

Real node servers (two, each with its own arena; in the shared case one ``fs`` tier in a
common folder), stub engines that prefill one request at a time at 4000 tokens/s and store
what they computed on their node server, and the router in front.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from stubs import (
    completion,
    held_by,
    node,
    post,
    router_config,
    running_router,
    stubs,
    with_engines,
)

from kvtier.prom import samples
from kvtier.router.config import CostModel

CHUNK = 16
PREFIX = [9000 + t for t in range(40 * CHUNK)]  # 40 chunks every request shares
BURST = 24


async def burst(tmp_path: Path, shared: bool) -> tuple[dict[str, int], Any, list[str]]:
    nodes = [node(tmp_path / n, tmp_path / "shared" if shared else None) for n in "ab"]
    try:
        async with stubs(2) as backends:
            servers = with_engines(backends, nodes, speed=4000, chunk_tokens=CHUNK)
            # everything shares this process's GIL here: give lookups more than the
            # default 0.1 s, so a burst measures the strategy, not the test's contention
            cost = CostModel(lookup_timeout_s=2.0)
            async with running_router(router_config(
                    backends, strategy="cache", kvtier_servers=servers, cost=cost)) as router, \
                    aiohttp.ClientSession() as s:
                await asyncio.sleep(0.3)  # namespaces read
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                _, _, h = await post(s, url, completion(PREFIX + [1] * CHUNK))
                warm = h["X-Kvtier-Backend"]
                other = next(i for i, b in enumerate(backends) if b.url != warm)
                if shared:  # wait until the other node's books show the prefix
                    deadline = time.monotonic() + 10
                    while len(held_by(nodes[other], PREFIX)) < 40:
                        assert time.monotonic() < deadline, "journal never caught up"
                        await asyncio.sleep(0.05)
                results = await asyncio.gather(*(
                    post(s, url, completion(PREFIX + [i + 2] * CHUNK)) for i in range(BURST)))
                assert all(status == 200 for status, _, _ in results)
                went = [h["X-Kvtier-Backend"] for _, _, h in results]
                counts = {"warm": went.count(warm), "other": BURST - went.count(warm)}
                failures = [router.metrics.registry.get_sample_value(
                    "kvtier_router_lookup_failures_total", {"server": url}) for url in servers]
                assert failures == [None, None], "every lookup answered"
                return counts, router.metrics.registry, [b.url for b in backends]
    finally:
        for n in nodes:
            n.stop()


def decisions(registry: Any, reason: str) -> float:
    return registry.get_sample_value("kvtier_router_decisions_total",
                                     {"strategy": "cache", "reason": reason}) or 0.0


def test_node_local_tiers_keep_affinity(tmp_path: Path) -> None:
    counts, registry, _ = asyncio.run(burst(tmp_path, shared=False))
    print(f"\nnode-local tiers: {counts} of a burst of {BURST}")
    assert counts["warm"] >= BURST - 1, counts
    assert decisions(registry, "affinity") >= BURST - 1


def test_a_shared_tier_lets_load_win(tmp_path: Path) -> None:
    counts, registry, _ = asyncio.run(burst(tmp_path, shared=True))
    print(f"\nshared tier: {counts} of a burst of {BURST}")
    assert counts["other"] >= BURST // 4, counts
    assert counts["warm"] >= BURST // 4, counts
    # once the other holds it too, later ones go there on a tie (affinity): some on load
    assert decisions(registry, "load") >= BURST // 8, "the other won on its queue"
    shared_hits = registry.get_sample_value("kvtier_router_hit_source_total",
                                            {"predicted": "shared", "actual": "shared"})
    assert shared_hits and shared_hits >= 1, "the other instance loaded from the shared tier"


async def staggered(tmp_path: Path, shared: bool, speed: float, weight: float = 1.0,
                    per_stream_s: float = 0.03) -> tuple[dict[str, int], float | None]:
    """Streams sharing PREFIX sent 150 ms apart, each decoding 8 steps of 0.05 s plus
    ``per_stream_s`` for each other stream on its backend: when one is routed the earlier
    ones are decoding (no longer in any prefill queue). Before them, the backends' prefill
    speed, decode time and step model are measured from cold streams, alone and three on
    each backend.
    Returns where the staggered ones went and the slope measured (one for the pool)."""
    nodes = [node(tmp_path / n, tmp_path / "shared" if shared else None) for n in "ab"]
    try:
        async with stubs(2) as backends:
            servers = with_engines(backends, nodes, speed=speed, chunk_tokens=CHUNK)
            for b in backends:
                b.tokens, b.token_s, b.token_s_per_stream = 9, 0.05, per_stream_s
            cost = CostModel(lookup_timeout_s=2.0, decode_weight=weight)
            async with running_router(router_config(
                    backends, strategy="cache", kvtier_servers=servers, cost=cost)) as router, \
                    aiohttp.ClientSession() as s:
                await asyncio.sleep(0.3)
                url = f"http://127.0.0.1:{router.port}/v1/completions"
                cold = iter(range(7000, 8000))
                for length, together in ((20, 1), (20, 1), (4, 6)):
                    # long ones alone (prefill speed), then short ones with longer answers
                    # three on each backend (decoding together)
                    for b in backends:
                        b.tokens = 9 if together == 1 else 20
                    await asyncio.gather(*(post(s, url, completion(
                        [next(cold)] * CHUNK * length, stream=True)) for _ in range(together)))
                for b in backends:
                    b.tokens = 9
                assert all(b.load.steps is router.pool.steps for b in router.pool), \
                    "one step model for the pool"
                slope = router.pool.steps.slope_s()
                async with s.get(f"http://127.0.0.1:{router.port}/metrics") as resp:
                    shown = samples(await resp.text(),
                                    ["kvtier_router_decode_step_seconds_per_stream"])
                assert [x.value for x in shown] == [slope or 0.0], "the router shows its slope"
                _, _, h = await post(s, url, completion(PREFIX + [1] * CHUNK, stream=True))
                warm = h["X-Kvtier-Backend"]
                other = next(i for i, b in enumerate(backends) if b.url != warm)
                if shared:
                    deadline = time.monotonic() + 10
                    while len(held_by(nodes[other], PREFIX)) < 40:
                        assert time.monotonic() < deadline, "journal never caught up"
                        await asyncio.sleep(0.05)

                async def later(i: int) -> str:
                    await asyncio.sleep(0.15 * i)
                    status, _, headers = await post(
                        s, url, completion(PREFIX + [i + 2] * CHUNK, stream=True))
                    assert status == 200
                    return str(headers["X-Kvtier-Backend"])

                went = await asyncio.gather(*(later(i) for i in range(6)))
                return {"warm": went.count(warm), "other": len(went) - went.count(warm)}, slope
    finally:
        for n in nodes:
            n.stop()


def test_streams_decoding_count_against_a_backend_as_measured(tmp_path: Path) -> None:
    """Each stream on a stub backend makes the others' steps 30 ms longer; the router
    measures that from the streams' chunks. With a shared tier the backend holding the prefix
    in its arena saves only a fast load: the streams decoding there make the other sooner.
    Without one, recomputing the prefix elsewhere (2.2 s here) costs more than sharing steps
    with a few streams (all at ``--decode-weight 1``: as measured). At weight 0 only
    prefill queues count: the holder keeps them all.
    Where streams do not slow each other the slope measured is about 0."""
    spread, slope = asyncio.run(staggered(tmp_path / "shared", shared=True, speed=300))
    kept, _ = asyncio.run(staggered(tmp_path / "local", shared=False, speed=300))
    off, _ = asyncio.run(staggered(tmp_path / "off", shared=True, speed=300, weight=0.0))
    flat, flat_slope = asyncio.run(staggered(tmp_path / "flat", shared=True, speed=300,
                                             per_stream_s=0.0))
    print(f"\nmeasured slope {slope} (flat steps: {flat_slope}); shared tier: {spread}; "
          f"node-local tiers: {kept}; weight 0: {off}; steps that do not grow: {flat}")
    assert slope is not None and 0.015 < slope < 0.045, slope
    assert flat_slope is not None and flat_slope < 0.01, flat_slope
    assert spread["other"] >= 2, spread
    assert kept["warm"] >= 5, kept
    assert off["warm"] >= 5, off
