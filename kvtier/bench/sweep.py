"""``kvtier bench sweep``: the multi-round workload over a range of sessions, per configuration.

::

    kvtier bench sweep --configs device,arena,arena+disk,example,lmcache --users 2,4,8,16 \
        --history 2000 --num-rounds 3 --device-blocks 64 --repeat 3 --out sweep/

For each repeat, and in it for each configuration (:mod:`kvtier.bench.stacks`; one at a time
so the engine has the machine's cores; each repeat starts further down the list and wraps
around: :func:`schedule`): start its stack, send one warm-up request, run each point (a number of
users and a history length) with text of its own seed (no point reuses another's KV; a
point's repeats share it: the same work, on a fresh stack), stop the stack. Every run is
written to ``OUT/sweep.json`` as it completes (:mod:`kvtier.bench.sweep_runs`: every run, and
per point the medians with their min and max), with its full results in ``OUT/points/`` and
its record in ``OUT/runs/`` (written first: :mod:`kvtier.bench.sweep_records`). A sweep that
was stopped or killed resumes when run again with the same ``--out``: it keeps every finished
run (failed ones too, unless ``--retry-failed``), runs the rest, adds the repeats a larger
``--repeat`` asks for, and refuses a folder made with other settings unless ``--fresh``.
At the end: ``cliff_ratio`` on the medians (:mod:`kvtier.bench.sweep_figure`), the table, and
``OUT/sweep.png`` (throughput and p99 TTFT against sessions, one line per configuration,
min-max error bars when there are repeats); then ``comparisons``: each configuration against
its setup's round robin (and the ``--compare`` pairs), each repeat's run against the
baseline's run of the same repeat, with a verdict that says only what every repeat agrees on
(:mod:`kvtier.bench.sweep_pairs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from kvtier.bench.multiround import DEMO_NAME, add_arguments
from kvtier.bench.stacks import STACKS, StackEnv, StartedConfig, get_stack
from kvtier.bench.sweep_command import command, invocation, now, settings
from kvtier.bench.sweep_pairs import parse_pair
from kvtier.bench.sweep_records import digest, forget, keep, recover
from kvtier.bench.sweep_runs import put_run, run_done, upgrade_v1
from kvtier.errors import ConfigError, KvtierError
from kvtier.tables import table

VERSION = 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="multi-round workload over a range of sessions for "
                       "several serving configurations (starts and stops each)")
    p.add_argument("--configs", default="device,arena,arena+disk",
                   help=f"comma list of: {', '.join(STACKS)} (default: %(default)s)")
    p.add_argument("--users", default="2,4,8,16", help="user counts (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="run every point K times, the configurations interleaved in each "
                   "repeat; the JSON keeps every run and each point's median and min-max "
                   "(default: %(default)s)")
    p.add_argument("--history", default="2000",
                   help="user history lengths in tokens (default: %(default)s)")
    p.add_argument("--out", default="sweep", help="results folder (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="start over, dropping earlier points")
    p.add_argument("--retry-failed", action="store_true", help="rerun points that failed")
    p.add_argument("--restart-per-point", action="store_true",
                   help="a fresh stack for every point (default: one per configuration)")
    p.add_argument("--list-configs", action="store_true", help="list configurations, exit")
    p.add_argument("--compare", action="append", default=[], metavar="CANDIDATE:BASELINE",
                   help="also compare these two configurations, run by run of each repeat "
                   "(repeatable; every SETUP+FRONT is compared with SETUP+roundrobin "
                   "anyway): kvtier.bench.sweep_pairs")
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


def load_doc(path: Path, wanted: dict[str, Any], fresh: bool) -> dict[str, Any]:
    if path.exists() and not fresh:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot resume ({exc}); use --fresh") from exc
        if doc.get("version") == 1:
            doc = upgrade_v1(doc)
        if doc.get("version") != VERSION or doc.get("settings") != wanted:
            old = doc.get("settings") or {}
            differ = sorted(k for k in set(old) | set(wanted) if old.get(k) != wanted.get(k))
            raise ConfigError(f"{path} was made with other settings ({', '.join(differ)}); "
                              "use --fresh to start over or another --out")
        return dict(doc)
    return {"benchmark": "kvtier bench sweep", "version": VERSION, "settings": wanted,
            "configs": {}}


def schedule(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, configuration) in the order they run: each repeat is one pass over every
    configuration, and repeat r starts (r-1)/K of the way down the list and wraps around,
    so drift slower than a pass hits every configuration in each repeat alike, and none
    always runs first or last (docs/benchmarks.md, "Repeats")."""
    order = []
    for r in range(repeats):
        start = r * len(names) // repeats
        order += [(r + 1, name) for name in names[start:] + names[:start]]
    return order


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
        self.invocation = len(doc.get("invocations", [])) - 1
        """Index in ``doc["invocations"]`` that each run of this process records."""
        self.settings_sha256 = digest(doc["settings"])
        self.broken: dict[str, str] = {}
        """Configurations that failed to start in this process: not tried again."""

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

    def run_config(self, name: str, repeat: int, users: list[int], histories: list[int]
                   ) -> None:
        """Repeat ``repeat`` of configuration ``name``: its runs not done yet, on one stack
        (a fresh one per point with ``--restart-per-point``) that is stopped at the end."""
        spec = get_stack(name)
        cfg = self.doc["configs"].setdefault(name, {"description": spec.description,
                                                    "points": [], "failure": None})
        todo = [(h, u) for h in histories for u in users
                if not run_done(cfg["points"], u, h, repeat, self.args.retry_failed)]
        if todo and name in self.broken:
            self._fail_rest(name, repeat, todo, self.broken[name])
            return
        stack: StartedConfig | None = None
        env: StackEnv | None = None
        try:
            for history, n in todo:
                if stack is None or not stack.alive() or self.args.restart_per_point:
                    if stack is not None:
                        self._stop(stack, env)
                    env = self.env(name)
                    print(f"kvtier bench sweep: starting {name} (repeat {repeat})",
                          file=sys.stderr, flush=True)
                    try:
                        stack = spec.start(env)
                        warm_up(stack, self.args.served_model_name)
                    except KvtierError as exc:
                        stack = None
                        self.broken[name] = str(exc)
                        self._fail_rest(name, repeat, todo[todo.index((history, n)):], str(exc))
                        return
                run = self.run_point(name, stack, history, n, repeat)
                self._put(name, n, history, repeat, run)
                self.save()
        finally:
            if stack is not None:
                self._stop(stack, env)

    def _put(self, name: str, users: int, history: int, repeat: int,
             run: dict[str, Any]) -> None:
        """Record a finished run: its own file first, then the point in memory."""
        run = {"repeat": repeat, "invocation": self.invocation, "finished": now(), **run}
        cfg = self.doc["configs"][name]
        keep(self.out, name, cfg["description"], users, history, run, self.settings_sha256,
             self.doc["invocations"][self.invocation])
        put_run(cfg["points"], users, history, run)

    def _stop(self, stack: StartedConfig, env: StackEnv | None) -> None:
        stack.stop()
        if env is not None:
            for data in ("disk", "example"):  # KV files; the logs stay
                shutil.rmtree(env.workdir / data, ignore_errors=True)

    def _fail_rest(self, name: str, repeat: int, todo: list[tuple[int, int]],
                   message: str) -> None:
        self.doc["configs"][name]["failure"] = message
        for history, n in todo:
            self._put(name, n, history, repeat, {"error": message, "throughput_tok_s": None,
                                                "p99_ttft_s": None, "hit_ratio": None})
        self.save()

    def run_point(self, name: str, stack: StartedConfig, history: int, users: int, repeat: int
                  ) -> dict[str, Any]:
        """One run of a point: its figures (:func:`run_of`); the full results to a file.
        Every repeat of a point sends the same text (its seed), to a fresh stack."""
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
                                   metrics_url=stack.metrics_url,
                                   load=load_config(point_args),
                                   label=f"{name} {users}u r{repeat}")
        print(f"kvtier bench sweep: {name}, {users} users, history {history}, "
              f"repeat {repeat}", file=sys.stderr, flush=True)
        result = execute(opts, progress=True)
        rel = Path("points") / f"{_safe(name)}-h{history}-u{users}-r{repeat}.json"
        write_json(result, self.out / rel)
        return run_of(result, str(rel), stack)


def _with_endpoint(ns: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), "model": None, "tokenizer": None,
                                 "api_key_env": None, "api_key_file": None, "label": ""})


def run_of(result: dict[str, Any], rel: str, stack: StartedConfig) -> dict[str, Any]:
    """A run's figures from its ``bench multiround`` results (``rel``: where they are)."""
    s, m = result["summary"], result["metrics"]
    endpoint = s["endpoint"] or {}
    error = None
    if s["requests"] and not s["ok"]:
        kinds = list(s["error_kinds"])
        error = f"every request failed: {kinds[0] if kinds else '?'}"
        if not stack.alive():
            error += "\n" + stack.log_tail(6)
    return {"throughput_tok_s": s["total_tok_s"] if error is None else None,
            "p99_ttft_s": m["p99_ttft"], "hit_ratio": m["hit_ratio"],
            "output_tok_s": s["output_tok_s"], "requests_per_s": s["requests_per_s"],
            "p50_ttft_s": m["p50_ttft"], "p99_itl_s": m["p99_itl"],
            "requests": s["requests"], "errors": s["errors"], "error_kinds": s["error_kinds"],
            "endpoint_cached_by_source": endpoint.get("cached_tokens_by_source"),
            "endpoint_loaded_by_tier": endpoint.get("kvtier_loaded_tokens"),
            "router_decisions": endpoint.get("router_decisions"),
            "router_work_ms": endpoint.get("router_work_ms"),
            "preemptions": endpoint.get("preemptions"),
            "machine_steal": _steal(result.get("machine")),
            "error": error, "result": rel}


def _steal(machine: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run's CPU steal in brief (:mod:`kvtier.bench.machine`): its total, its worst
    rate, and how many spells; the point's own JSON has every spell."""
    if not machine:
        return None
    return {"cpu_s": machine["steal_cpu_s"], "worst_cpus": machine["worst_steal_cpus"],
            "spells": len(machine["steal_spells"])}


def warm_up(stack: StartedConfig, model: str) -> None:
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
    if args.list_configs:
        print(table(None, [[s.name, s.description] for s in STACKS.values()], align="ll"))
        return 0
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:
        get_stack(name)
    users, histories = _ints(args.users, "--users"), _ints(args.history, "--history")
    if args.repeat < 1:
        raise ConfigError(f"--repeat: expected at least 1 run per point, got {args.repeat}")
    pairs = [parse_pair(text) for text in args.compare]
    if args.model:
        model = str(Path(args.model).expanduser().resolve())
    else:
        from kvtier.demo import ensure_demo_model

        model = str(ensure_demo_model())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = settings(args, model)
    doc = load_doc(out / "sweep.json", wanted, args.fresh)
    if args.fresh:
        forget(out)
    recovered = recover(out, doc, digest(wanted))
    for pair in pairs:
        for name in pair:
            if name not in names and name not in doc.get("configs", {}):
                raise ConfigError(f"--compare {pair[0]}:{pair[1]}: {name!r} is neither in "
                                  f"--configs nor in {out / 'sweep.json'} already")
    doc["command"] = command(args)
    if doc["command"] not in doc.setdefault("commands", []):
        doc["commands"].append(doc["command"])  # every invocation that added points
    doc.setdefault("invocations", []).append(invocation(args))
    sweep = Sweep(args, model, out, doc)
    _say_progress(out, doc, schedule(names, args.repeat), users, histories, recovered,
                  args.retry_failed)
    try:
        for repeat, name in schedule(names, args.repeat):
            sweep.run_config(name, repeat, users, histories)
    except KeyboardInterrupt:  # Ctrl-C or SIGINT: the stack is stopped on the way out
        print(f"kvtier bench sweep: stopped; every finished run is kept in {out / 'runs'}: "
              "run the same command again to go on", file=sys.stderr)
        return 130
    finish(sweep, histories, pairs)
    return 0


def _say_progress(out: Path, doc: dict[str, Any], order: list[tuple[int, str]],
                  users: list[int], histories: list[int], recovered: int,
                  retry_failed: bool) -> None:
    """Say what a rerun keeps and what it still runs."""
    total = len(order) * len(users) * len(histories)
    done = sum(1 for repeat, name in order for h in histories for u in users
               if name in doc["configs"]
               and run_done(doc["configs"][name]["points"], u, h, repeat, retry_failed))
    if done:
        kept = f" ({recovered} from {out / 'runs'})" if recovered else ""
        print(f"kvtier bench sweep: resuming {out}: {done} of {total} runs done and kept"
              f"{kept}, {total - done} to run (--fresh starts over)", file=sys.stderr)


def finish(sweep: Sweep, histories: list[int], pairs: list[tuple[str, str]]) -> None:
    """The cliff (on the points' medians) and the paired comparisons into the JSON, the
    tables, the figure."""
    from kvtier.bench import sweep_figure, sweep_pairs

    doc = sweep.doc
    cliffs = [sweep_figure.cliff(doc["configs"], h) for h in histories]
    doc["cliff"] = cliffs
    doc["cliff_ratio"] = cliffs[0]["cliff_ratio"]
    doc["cliff_ratio_is_lower_bound"] = cliffs[0]["cliff_ratio_is_lower_bound"]
    wanted = sweep_pairs.default_pairs(doc["configs"])
    wanted += [p for p in pairs if p not in wanted]
    doc["comparisons"] = sweep_pairs.compare(doc["configs"], wanted)
    sweep.save()
    print(sweep_figure.table_text(doc["configs"]))
    print(sweep_figure.summary_line(cliffs[0]))
    if doc["comparisons"]:
        print(sweep_pairs.table_text(doc["comparisons"]))
    try:
        sweep_figure.plot(doc, str(sweep.out / "sweep.png"))
    except ImportError:
        print("matplotlib is missing: no sweep.png (pip install 'kvtier[plot]')",
              file=sys.stderr)
