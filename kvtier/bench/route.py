"""``kvtier bench route``: the router's own overhead, direct vs through ``kvtier route``.

A stub backend that answers at once (:mod:`kvtier.bench.stub_backend`) and ``kvtier route``
run as processes of their own; this process is the client. In one run:

- **latency**: ``--requests`` sequential requests, alternating direct and routed (so drift
  hits both alike); p50 / p99 of each and the difference, for whole answers and for a
  stream's first chunk;
- **throughput**: ``--concurrency`` clients sending as fast as they can for ``--duration-s``,
  direct, then routed: requests per second.

On a small machine the stub, the router and the client share the cores, so the routed
figures include the contention of one more process; the router's cost on a machine of its
own is at most this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ServiceStartError
from kvtier.httpjson import answers_200
from kvtier.ports import free_ports
from kvtier.processes import Child, stop_group, wait_ready
from kvtier.tables import table

STOP_TIMEOUT_S = 30.0

MODEL = "stub"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="the router's own overhead: added latency (p50/p99) and "
                       "requests/s, direct vs through kvtier route, against a stub backend")
    p.add_argument("--requests", type=int, default=400, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=4.0, help="per throughput phase")
    p.add_argument("--strategy", default="roundrobin",
                   choices=("roundrobin", "session", "prefix", "cache"))
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    figures = bench(args.requests, args.concurrency, args.duration_s, args.strategy)
    print_figures(figures)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


def bench(requests: int, concurrency: int, duration_s: float, strategy: str) -> dict[str, Any]:
    stub_port, router_port = free_ports(2)
    direct = f"http://127.0.0.1:{stub_port}"
    routed = f"http://127.0.0.1:{router_port}"
    started: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-route-") as logs:
        try:
            _start(started, Path(logs), "stub", direct, [
                sys.executable, "-m", "kvtier.bench.stub_backend", "--port", str(stub_port)])
            _start(started, Path(logs), "router", routed, [
                sys.executable, "-m", "kvtier", "route", "--backends", direct, "--port",
                str(router_port), "--strategy", strategy, "--log-level", "warning"])
            figures = asyncio.run(_measure(direct, routed, requests, concurrency, duration_s))
        finally:
            for proc in reversed(started):
                stop_group(proc.popen, STOP_TIMEOUT_S)
    figures.update({"strategy": strategy, "requests": requests, "concurrency": concurrency,
                    "duration_s": duration_s, "cpus": os.cpu_count()})
    return figures


async def _measure(direct: str, routed: str, requests: int, concurrency: int,
                   duration_s: float) -> dict[str, Any]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        out: dict[str, Any] = {}
        for stream in (False, True):
            name = "stream_first_chunk" if stream else "whole"
            d, r = await _latencies(s, direct, routed, requests, stream)
            out[name] = {"direct": _summary(d), "routed": _summary(r),
                         "added_p50_ms": 1e3 * (_pct(r, 50) - _pct(d, 50)),
                         "added_p99_ms": 1e3 * (_pct(r, 99) - _pct(d, 99))}
        out["throughput"] = {
            "direct_rps": await _throughput(s, direct, concurrency, duration_s),
            "routed_rps": await _throughput(s, routed, concurrency, duration_s)}
        return out


async def _latencies(s: Any, direct: str, routed: str, n: int, stream: bool
                     ) -> tuple[list[float], list[float]]:
    body = _body(stream)
    for url in (direct, routed):  # warm connections and code paths
        for _ in range(20):
            await _one(s, url, body)
    d: list[float] = []
    r: list[float] = []
    for _ in range(n):
        d.append(await _one(s, direct, body))
        r.append(await _one(s, routed, body))
    return d, r


async def _one(s: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds to the whole answer, or to a stream's first chunk (the rest is read)."""
    start = time.perf_counter()
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        if body["stream"]:
            await resp.content.readany()
            took = time.perf_counter() - start
            await resp.read()
            return took
        await resp.read()
        return time.perf_counter() - start


async def _throughput(s: Any, url: str, concurrency: int, duration_s: float) -> float:
    body = _body(False)
    stop = time.perf_counter() + duration_s
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await _one(s, url, body)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def _body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The router's own overhead.", "max_tokens": 1,
            "stream": stream}


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": 1e3 * _pct(xs, 50), "p99_ms": 1e3 * _pct(xs, 99),
            "mean_ms": 1e3 * statistics.fmean(xs)}


def _pct(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def print_figures(f: dict[str, Any]) -> None:
    print(f"kvtier bench route (strategy {f['strategy']}, stub backend, {f['cpus']} CPUs; "
          f"{f['requests']} sequential requests per path, {f['concurrency']} clients for "
          f"{f['duration_s']:.0f} s)")
    rows = []
    for name in ("whole", "stream_first_chunk"):
        row = f[name]
        d, r = row["direct"], row["routed"]
        rows.append([f"{name} (ms)", *(f"{v:.3f}" for v in (
            d["p50_ms"], r["p50_ms"], row["added_p50_ms"], d["p99_ms"], r["p99_ms"],
            row["added_p99_ms"]))])
    t = f["throughput"]
    rows.append(["requests/s", f"{t['direct_rps']:.0f}", f"{t['routed_rps']:.0f}",
                 *[""] * 4])
    print(table(["", "direct p50", "routed p50", "added p50", "direct p99", "routed p99",
                 "added p99"], rows))
    print(f"requests/s routed / direct = {t['routed_rps'] / t['direct_rps']:.2f}")


def _start(started: list[Child], logs: Path, name: str, url: str, argv: list[str],
           timeout_s: float = 60.0) -> None:
    """Start ``argv`` (noted in ``started`` at once, to be stopped) and wait until
    ``url``/health answers 200."""
    proc = Child.start(name, argv, logs / f"{name}.log")
    started.append(proc)
    if wait_ready(answers_200(f"{url}/health", timeout_s=2.0), timeout_s=timeout_s,
                  alive=lambda: proc.running, every_s=0.1):
        return
    if not proc.running:
        raise ServiceStartError(f"{argv!r} exited: {proc.tail()}")
    raise ServiceStartError(f"{url} did not come up within {timeout_s:.0f} s")
