"""``kvtier bench route``: the router's own overhead, direct vs through ``kvtier route``.

A stub backend that answers at once (:mod:`kvtier.bench.stub_backend`) and ``kvtier route``
run as processes of their own; this process is the client. In one run:

- **latency**: ``--requests`` sequential requests, alternating direct and routed (so drift
  hits both alike); p50 / p99 of each and the difference, for whole answers and for a
  stream's first chunk;
- **throughput**: ``--concurrency`` clients sending as fast as they can for ``--duration-s``,
  direct, then routed: requests per second, and the router's CPU time per request (its
  process's user + system time over the routed phase);
- **the strategy's own work**, from the router's ``/metrics`` after the latency phase: the
  mean time of a decision, of a request's keying (chat template, tokenizer, chunk hashes)
  and of a decision's node-server lookups.

With a strategy that keys prompts (``cache``, ``prefix``) a node server runs too, with the
demo model's namespace registered (as the vLLM connector registers it), so the router renders,
tokenizes and hashes each chat prompt with the real tokenizer and asks the node server about
its keys on every request: what these strategies cost in production. The prompts are turns of
chats as the multi-round benchmark sends them (:class:`Chats`): each chat opens with about
``--prompt-tokens`` tokens of its own and grows by a short answer and question a turn, for
``--turns`` turns (default :data:`TURNS`), then a new chat takes its place: one request in
``--turns`` opens a chat (``--turns 1``: every prompt is new to the router).

On a small machine the stub, the router and the client share the cores, so the routed
figures include the contention of one more process; the router's cost on a machine of its
own is at most this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from kvtier.bench.textgen import prose
from kvtier.errors import ServiceStartError
from kvtier.httpjson import answers_200
from kvtier.ports import free_ports
from kvtier.processes import Child, stop_group, wait_ready
from kvtier.tables import table

STOP_TIMEOUT_S = 30.0

MODEL = "stub"
NAMESPACE = bytes(range(32))
"""The namespace the benchmark's node server registers for the demo model."""
CHUNK_TOKENS = 256


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="the router's own overhead: added latency (p50/p99) and "
                       "requests/s, direct vs through kvtier route, against a stub backend")
    p.add_argument("--requests", type=int, default=400, help="sequential requests per path")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=4.0, help="per throughput phase")
    p.add_argument("--strategy", default="roundrobin",
                   choices=("roundrobin", "session", "prefix", "cache"))
    p.add_argument("--prompt-tokens", type=int, default=2000,
                   help="chats open with about this many tokens, keyed by cache and prefix "
                   "(the demo model's tokenizer; other strategies get a one-line prompt)")
    p.add_argument("--turns", type=int, default=TURNS,
                   help="turns of each chat; one request in this many opens a new chat "
                   "(default: %(default)s)")
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--turns", args.turns)):
        if value < 1:
            print(f"kvtier bench route: {flag} must be at least 1", file=sys.stderr)
            return 2
    figures = bench(args.requests, args.concurrency, args.duration_s, args.strategy,
                    args.prompt_tokens, args.turns)
    print_figures(figures)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


KEYED = ("cache", "prefix")
"""Strategies that key the prompt (and then need a node server's namespace)."""


def bench(requests: int, concurrency: int, duration_s: float, strategy: str,
          prompt_tokens: int = 2000, turns: int = 4) -> dict[str, Any]:
    stub_port, router_port, node_port = free_ports(3)
    direct = f"http://127.0.0.1:{stub_port}"
    routed = f"http://127.0.0.1:{router_port}"
    keyed = strategy in KEYED
    started: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-route-") as logs:
        try:
            _start(started, Path(logs), "stub", f"{direct}/health", [
                sys.executable, "-m", "kvtier.bench.stub_backend", "--port", str(stub_port)])
            nodes: list[str] = []
            if keyed:
                nodes = [_start_node(started, Path(logs), node_port)]
            _start(started, Path(logs), "router", f"{routed}/health", [
                sys.executable, "-m", "kvtier", "route", "--backends", direct, "--port",
                str(router_port), "--strategy", strategy, "--log-level", "warning",
                *(["--kvtier-servers", ",".join(nodes)] if nodes else [])])
            prompt = Chats(prompt_tokens, turns) if keyed else None
            router = psutil.Process(started[-1].pid)
            figures = asyncio.run(_measure(direct, routed, requests, concurrency, duration_s,
                                           prompt, router))
        finally:
            for proc in reversed(started):
                stop_group(proc.popen, STOP_TIMEOUT_S)
    figures.update({"strategy": strategy, "requests": requests, "concurrency": concurrency,
                    "duration_s": duration_s, "cpus": os.cpu_count(),
                    "prompt": f"chats opening with about {prompt_tokens} tokens, {turns} "
                    f"turns each, keyed" if keyed
                    else "completion, one line"})
    return figures


def _start_node(started: list[Child], logs: Path, port: int) -> str:
    """A node server with the demo model's namespace registered, as the vLLM connector
    registers it (its tokenizer is what the router keys prompts with); returns its URL."""
    from kvtier.client import KvtierClient
    from kvtier.demo.model import ensure_demo_model
    from kvtier.protocol import Register

    model = ensure_demo_model()
    socket_path = logs / "node.sock"
    config = logs / "node.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "socket_path": str(socket_path), "arena": {"size_bytes": 64 << 20},
        "metrics_port": port, "metrics_host": "127.0.0.1"}))
    url = f"http://127.0.0.1:{port}"
    _start(started, logs, "node", f"{url}/healthz", [
        sys.executable, "-m", "kvtier", "server", "--config", str(config)])
    with KvtierClient(str(socket_path)) as client:
        client.call(Register(NAMESPACE, {"model": str(model), "chunk_tokens": CHUNK_TOKENS,
                                         "served_model_name": MODEL, "tokenizer": str(model),
                                         "namespace": NAMESPACE.hex()[:16]}))
    return url


TURNS = 4
"""Turns of each chat by default (as the sweep's ``--num-rounds 4``)."""
CHATS = 16
"""Chats open at once: consecutive requests are turns of different chats."""


class Chats:
    """Request messages: turns of :data:`CHATS` chats in rotation, each opening with about
    ``tokens`` tokens of prose of its own (the demo tokenizer makes ~4 characters a token)
    and growing by an answer and a question (~80 tokens) a turn; after ``turns`` turns a
    chat is replaced by a new one."""

    def __init__(self, tokens: int, turns: int = TURNS, seed: int = 0) -> None:
        self.tokens = tokens
        self.turns = turns
        self.seed = seed
        self._sent = 0
        self._open: dict[int, list[dict[str, str]]] = {}
        """Each slot's chat so far: a turn extends it instead of writing it all again."""

    def next_messages(self) -> list[dict[str, str]]:
        i, self._sent = self._sent, self._sent + 1
        slot, turn = i % CHATS, (i // CHATS) % self.turns
        chat = i // (CHATS * self.turns) * CHATS + slot

        def text(what: str, words: int) -> str:
            return prose(random.Random(f"{self.seed}:{chat}:{what}"), words)

        if turn == 0:
            opening = text("opening", max(1, self.tokens * 3 // 4))[: 4 * self.tokens]
            self._open[slot] = [{"role": "user", "content": opening}]
        else:
            self._open[slot] += [{"role": "assistant", "content": text(f"answer {turn - 1}", 24)},
                                 {"role": "user", "content": text(f"question {turn - 1}", 36)}]
        return list(self._open[slot])


async def _measure(direct: str, routed: str, requests: int, concurrency: int,
                   duration_s: float, prompt: Chats | None, router: psutil.Process
                   ) -> dict[str, Any]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        out: dict[str, Any] = {}
        for stream in (False, True):
            name = "stream_first_chunk" if stream else "whole"
            d, r = await _latencies(s, direct, routed, requests, stream, prompt)
            out[name] = {"direct": _summary(d), "routed": _summary(r),
                         "added_p50_ms": 1e3 * (_pct(r, 50) - _pct(d, 50)),
                         "added_p99_ms": 1e3 * (_pct(r, 99) - _pct(d, 99))}
        out["strategy_work"] = await _strategy_work(s, routed)
        direct_rps, _ = await _throughput(s, direct, concurrency, duration_s, prompt)
        cpu_before = _cpu_s(router)
        routed_rps, routed_done = await _throughput(s, routed, concurrency, duration_s, prompt)
        cpu = _cpu_s(router) - cpu_before
        out["throughput"] = {"direct_rps": direct_rps, "routed_rps": routed_rps,
                             "router_cpu_ms_per_request": 1e3 * cpu / max(1, routed_done)}
        return out


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


async def _strategy_work(s: Any, routed: str) -> dict[str, float | None]:
    """Mean milliseconds per decision, per keyed request and per decision's lookups, from
    the router's histograms (None: it did none)."""
    from kvtier.prom import samples

    async with s.get(f"{routed}/metrics") as resp:
        text = await resp.text()
    wanted = {"kvtier_router_decision_seconds", "kvtier_router_keying_seconds",
              "kvtier_router_lookup_seconds"}
    found = samples(text, {f"{n}_{p}" for n in wanted for p in ("sum", "count")})
    out: dict[str, float | None] = {}
    for name, key in (("decision_ms", "decision"), ("keying_ms", "keying"),
                      ("lookups_ms", "lookup")):
        total = sum(x.value for x in found if x.name == f"kvtier_router_{key}_seconds_sum")
        count = sum(x.value for x in found if x.name == f"kvtier_router_{key}_seconds_count")
        out[name] = 1e3 * total / count if count else None
    return out


async def _latencies(s: Any, direct: str, routed: str, n: int, stream: bool,
                     prompt: Chats | None) -> tuple[list[float], list[float]]:
    for url in (direct, routed):  # warm connections and code paths
        for _ in range(20):
            await _one(s, url, _body(stream, prompt))
    d: list[float] = []
    r: list[float] = []
    for _ in range(n):
        body = _body(stream, prompt)  # the same request both ways
        d.append(await _one(s, direct, body))
        r.append(await _one(s, routed, body))
    return d, r


async def _one(s: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds to the whole answer, or to a stream's first chunk (the rest is read)."""
    start = time.perf_counter()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with s.post(f"{url}{path}", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        if body["stream"]:
            await resp.content.readany()
            took = time.perf_counter() - start
            await resp.read()
            return took
        await resp.read()
        return time.perf_counter() - start


async def _throughput(s: Any, url: str, concurrency: int, duration_s: float,
                      prompt: Chats | None) -> tuple[float, int]:
    """Requests per second with ``concurrency`` clients for ``duration_s``, and how many."""
    stop = time.perf_counter() + duration_s
    done = 0

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await _one(s, url, _body(False, prompt))
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return done / (time.perf_counter() - start), done


def _body(stream: bool, prompt: Chats | None = None) -> dict[str, Any]:
    if prompt is not None:
        return {"model": MODEL, "messages": prompt.next_messages(),
                "max_tokens": 1, "stream": stream}
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
          f"{f['duration_s']:.0f} s; prompt: {f['prompt']})")
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
    print(f"requests/s routed / direct = {t['routed_rps'] / t['direct_rps']:.2f}; "
          f"router CPU per routed request {t['router_cpu_ms_per_request']:.3f} ms")
    work = f["strategy_work"]
    print("the strategy's own work, mean per request (sequential phase): " + ", ".join(
        f"{name} {'-' if work[key] is None else f'{work[key]:.3f} ms'}"
        for name, key in (("decision", "decision_ms"), ("keying", "keying_ms"),
                          ("node lookups", "lookups_ms"))))


def _start(started: list[Child], logs: Path, name: str, url: str, argv: list[str],
           timeout_s: float = 60.0) -> None:
    """Start ``argv`` (noted in ``started`` at once, to be stopped) and wait until ``url``
    answers 200."""
    proc = Child.start(name, argv, logs / f"{name}.log")
    started.append(proc)
    if wait_ready(answers_200(url, timeout_s=2.0), timeout_s=timeout_s,
                  alive=lambda: proc.running, every_s=0.1):
        return
    if not proc.running:
        raise ServiceStartError(f"{argv!r} exited: {proc.tail()}")
    raise ServiceStartError(f"{url} did not come up within {timeout_s:.0f} s")
