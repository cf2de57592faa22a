"""``kvtier bench agents``: agent sessions through vLLM behind ``kvtier route``, retention on
against off.

::

    kvtier bench agents --out agents-out --retention on,off --repeats 3

Each run starts a fresh stack, ``kvtier serve --instances 1 --router kvtier --router-policy
roundrobin --shared none`` (one vLLM instance bound to one core, its node server with a
host-RAM arena of ``--arena-size`` and no tier below it, the router in front; the sweep's
``1x-noshare+roundrobin`` configuration), sends one warm-up request, then plays the agent
workload (:mod:`kvtier.bench.agents_workload`: ``--sessions`` sessions of ``--turns`` turns,
tool calls and idle gaps on a clock scaled by ``--time-scale``, more sessions live than the
arena holds) and stops the stack. With ``--retention on`` every request carries
``kv_transfer_params.kvtier.retention`` for its answer's kind (``release`` on a session's last
turn); ``off`` sends the very same requests without it. ``--repeats K`` runs the modes in the
order given, K times (on, off, on, off, ...). ``--url`` plays against a running endpoint
instead (one run per mode and repeat, the endpoint's cache carried from run to run).

Every run is kept in ``OUT/runs/NNN-MODE.json`` (its figures and every request: the turn, what
it follows, TTFT, prompt and cached tokens, a digest of the answer) and ``OUT/agents.json``
is rewritten from all the runs in ``OUT`` after each: so a script can run one mode at a
time, each under a lock of its own, into one folder (docs/results/retention-e2e/run.sh), and
``--report`` prints the table again. Figures: :mod:`kvtier.bench.agents_report`.

Streamed answers carry no per-tier accounting in vLLM 0.32, so a turn's hits are vLLM's
``usage.prompt_tokens_details.cached_tokens`` (device and arena together); the tiers come
from the instance's counters (``device``, ``host``: kvtier's arena) and the node server's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtier.bench import agents_report as report
from kvtier.bench.agents_workload import AgentsConfig, AgentsWorkload, build
from kvtier.bench.openai_client import Endpoint, EndpointConfig, RequestResult, RequestSpec
from kvtier.bench.textgen import text_of
from kvtier.bench.tokens import TokenCounter, counter_for
from kvtier.config import parse_size
from kvtier.errors import ConfigError

STACK = "1x-noshare+roundrobin"
MODES = ("on", "off")
NODE_PORT_OFFSET = 101
"""Instance 0's node server listens on the router's port + 101 (kvtier serve --instances)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agents", help="agent sessions (tool calls, idle gaps) through vLLM "
                       "behind kvtier route: TTFT with retention hints on against off")
    d = AgentsConfig()
    p.add_argument("--out", required=True, help="folder of the runs and agents.json")
    p.add_argument("--retention", default="on,off", help="modes to run, in order, "
                   "comma-separated: on, off (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="passes over the modes")
    p.add_argument("--report", action="store_true", help="only print OUT's table")
    p.add_argument("--url", help="a running endpoint instead of a fresh stack per run")
    p.add_argument("--node-metrics-url", help="with --url: its node server's /metrics")
    g = p.add_argument_group("workload (lengths in tokens, gaps in trace seconds)")
    g.add_argument("--sessions", type=int, default=d.sessions)
    g.add_argument("--turns", type=int, default=d.turns)
    g.add_argument("--system-prompt", type=int, default=d.system_prompt_tokens)
    g.add_argument("--context-len", type=int, default=d.context_tokens)
    g.add_argument("--tool-result-len", type=int, default=d.tool_result_tokens)
    g.add_argument("--user-message-len", type=int, default=d.user_message_tokens)
    g.add_argument("--answer-len", type=int, default=d.answer_tokens)
    g.add_argument("--tool-call-share", type=float, default=d.tool_call_share)
    g.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="run seconds per trace second (default: %(default)s)")
    g.add_argument("--arrival-window", type=float, default=d.arrival_window_s,
                   help="run seconds over which the sessions start")
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("the stack")
    g.add_argument("--arena-size", default="48MiB")
    g.add_argument("--device-blocks", type=int, default=33,
                   help="vLLM's own cache, in blocks (128 tokens on the CPU build)")
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--chunk-tokens", type=int, default=256)
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="one more vLLM flag (repeatable)")
    g.add_argument("--ready-timeout", type=float, default=600.0)
    g.add_argument("--run-timeout", type=float, default=900.0,
                   help="a run's workload is cut off after this many seconds")
    p.set_defaults(func=run)


def workload_config(args: argparse.Namespace) -> AgentsConfig:
    return AgentsConfig(
        sessions=args.sessions, turns=args.turns, system_prompt_tokens=args.system_prompt,
        context_tokens=args.context_len, tool_result_tokens=args.tool_result_len,
        user_message_tokens=args.user_message_len, answer_tokens=args.answer_len,
        tool_call_share=args.tool_call_share, time_scale=args.time_scale,
        arrival_window_s=args.arrival_window, seed=args.seed)


def modes(text: str) -> list[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise ConfigError(f"--retention: got {text!r}; allowed: on, off, or both "
                          "comma-separated")
    return out


def engine_args(args: argparse.Namespace) -> list[str]:
    # vLLM keeps one block back (its null block) and refuses to start without room for one
    # request of --max-model-len
    if (args.device_blocks - 1) * 128 < args.max_model_len:
        raise ConfigError(f"--device-blocks {args.device_blocks}: less one block, x 128 tokens "
                          f"is less than --max-model-len {args.max_model_len}")
    return ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--num-gpu-blocks-override", str(args.device_blocks), "--enforce-eager",
            "--enable-prompt-tokens-details", "--seed", "0",
            "--kv-cache-memory-bytes", str(1 << 30), *args.vllm_arg]


# ------------------------------------------------------------------ one run


async def play(wl: AgentsWorkload, endpoint: Endpoint, retention: bool,
               counter: TokenCounter, max_in_flight: int = 0) -> list[dict[str, Any]]:
    """Every session of ``wl`` against ``endpoint``, each turn after its gap; one row per
    request, in the order they finished. ``max_in_flight`` > 0 holds a turn back while
    that many requests are out (1: each request runs alone on the engine, so its tokens do
    not depend on what it was batched with)."""
    cfg = wl.config
    t0 = endpoint.now()
    rows: list[dict[str, Any]] = []
    cap = asyncio.Semaphore(max_in_flight) if max_in_flight > 0 else None

    async def send(spec: RequestSpec) -> RequestResult:
        if cap is None:
            return await endpoint.send(spec)
        async with cap:
            return await endpoint.send(spec)

    async def session(i: int) -> None:
        s = wl.sessions[i]
        await asyncio.sleep(max(0.0, t0 + s.start_s - endpoint.now()))
        answers: list[str] = []
        for t in range(cfg.turns):
            spec = RequestSpec(i, t, False, cfg.answer_tokens,
                               messages=wl.messages(i, t, answers),
                               kv_transfer_params=wl.params(i, t, retention))
            result = await send(spec)
            rows.append(turn_row(wl, result, t0))
            answers.append(result.text if result.ok and result.text else
                           text_of(counter, cfg.answer_tokens,
                                   random.Random(f"kvtier-agents-fallback:{i}:{t}")))
            if t < cfg.turns - 1:
                await asyncio.sleep(s.gaps_s[t])

    await asyncio.gather(*(session(i) for i in range(len(wl.sessions))))
    return rows


def turn_row(wl: AgentsWorkload, r: RequestResult, t0: float) -> dict[str, Any]:
    cached = (r.kv_tokens or {}).get("cached") if r.kv_source == "cached_tokens" else None
    return {"session": r.user, "turn": r.round, "after": wl.after(r.user, r.round),
            "kind": wl.sessions[r.user].kinds[r.round],
            "start_s": round(r.start_s - t0, 4),
            "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 5),
            "e2e_s": round(r.e2e_s, 5), "prompt_tokens": r.prompt_tokens,
            "cached_tokens": cached, "output_tokens": r.output_tokens,
            "answer_sha256": hashlib.sha256(r.text.encode()).hexdigest()[:16],
            "backend": r.backend, "error": r.error}


async def measure(url: str, model: str, wl: AgentsWorkload, retention: bool,
                  counter: TokenCounter, metrics_urls: Sequence[str], node_url: str | None,
                  timeout_s: float, max_in_flight: int = 0) -> dict[str, Any]:
    """One run against ``url``: the rows, and the counters' change over it."""
    from kvtier.bench import prom

    endpoint = Endpoint(EndpointConfig(url=url, model=model, api="chat", stream=True,
                                       ignore_eos=True, timeout_s=120.0))
    before = await asyncio.to_thread(prom.scrape_all, metrics_urls) if metrics_urls else None
    node_before = await asyncio.to_thread(_node, node_url)
    start = endpoint.now()
    try:
        rows = await asyncio.wait_for(play(wl, endpoint, retention, counter,
                                                max_in_flight), timeout_s)
    finally:
        await endpoint.close()
    duration = endpoint.now() - start
    after = await asyncio.to_thread(prom.scrape_all, metrics_urls) if metrics_urls else None
    node = report.node_delta(node_before, await asyncio.to_thread(_node, node_url))
    delta = prom.delta(before, after) if before is not None and after is not None else None
    rows.sort(key=lambda r: (r["session"], r["turn"]))
    return {"figures": report.run_figures(rows, duration, delta, node), "endpoint": delta,
            "node": node, "requests": rows}


def _node(url: str | None) -> dict[str, float] | None:
    if not url:
        return None
    import httpx

    try:
        resp = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    return report.node_counters(resp.text) if resp.status_code == 200 else None


# ------------------------------------------------------------------ runs and repeats


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.report:
        return _report(out)
    order = modes(args.retention)
    if args.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    config = workload_config(args)
    from kvtier.demo.model import DEMO_NAME, ensure_demo_model

    model = str(ensure_demo_model())  # built on first use
    counter = counter_for(model)
    wl = build(config, counter)
    for _ in range(args.repeats):
        for mode in order:
            n = len(_runs(out)) + 1
            print(f"kvtier bench agents: run {n}, retention {mode}", file=sys.stderr,
                  flush=True)
            doc = _one(args, out / "work" / f"run-{n:03d}", wl, mode == "on", counter,
                       model, DEMO_NAME, engine_args(args) if not args.url else [])
            doc.update({"run": n, "retention": mode, "command": _command(),
                        "time": datetime.datetime.now(datetime.UTC).isoformat(
                            timespec="seconds"),
                        "workload": asdict(config), "engine_args": engine_args(args),
                        "arena_bytes": parse_size(args.arena_size)})
            from kvtier.bench.mr_output import write_json

            write_json(doc, out / "runs" / f"{n:03d}-{mode}.json")
            _summarize(out)
    return _report(out)


def _one(args: argparse.Namespace, workdir: Path, wl: AgentsWorkload, retention: bool,
         counter: TokenCounter, model: str, served: str, engine: list[str]
         ) -> dict[str, Any]:
    from kvtier.bench.provenance import provenance

    if args.url:
        doc = asyncio.run(measure(args.url, served, wl, retention, counter,
                                  [f"{args.url.rstrip('/')}/metrics"], args.node_metrics_url,
                                  args.run_timeout))
        return {**doc, "provenance": provenance()}
    from kvtier.bench.stacks import StackEnv, get_stack
    from kvtier.bench.sweep import warm_up

    env = StackEnv(model=model, served_name=served, engine_args=tuple(engine),
                   workdir=workdir, arena_bytes=parse_size(args.arena_size),
                   chunk_tokens=args.chunk_tokens, ready_timeout_s=args.ready_timeout,
                   env={"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))})
    stack = get_stack(STACK).start(env)
    try:
        warm_up(stack, served)
        port = urlsplit(stack.url).port or 0
        node = f"http://127.0.0.1:{port + NODE_PORT_OFFSET}/metrics"
        doc = asyncio.run(measure(stack.url, served, wl, retention, counter,
                                  stack.metrics_urls, node, args.run_timeout))
    finally:
        stack.stop()
    return {**doc, "provenance": provenance(), "stack": STACK}


def _command() -> str:
    return " ".join(["kvtier", *sys.argv[1:]])


def _runs(out: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted((out / "runs").glob("*.json")):
        doc = json.loads(path.read_text())
        figures = doc["figures"]
        if "requests" in doc:  # from what was measured, by this version's rules
            figures = report.run_figures(doc["requests"], figures["duration_s"],
                                         doc.get("endpoint"), doc.get("node"))
        runs.append({"run": doc["run"], "retention": doc["retention"], "figures": figures,
                     "file": f"runs/{path.name}"})
    return sorted(runs, key=lambda r: r["run"])


def _summarize(out: Path) -> dict[str, Any]:
    from kvtier.bench.mr_output import write_json

    runs = _runs(out)
    doc = {"benchmark": "kvtier bench agents", "version": 1, "runs": runs,
           "combined": report.combine(runs)}
    write_json(doc, out / "agents.json")
    return doc


def _report(out: Path) -> int:
    if not (out / "runs").is_dir():
        raise ConfigError(f"--report: no runs in {out}/runs")
    doc = _summarize(out)
    print(f"kvtier bench agents: {len(doc['runs'])} runs "
          f"({', '.join(r['retention'] for r in doc['runs'])})")
    report.print_combined(doc["combined"])
    errors = sum(int(r["figures"].get("errors") or 0) for r in doc["runs"])
    return 1 if errors else 0
