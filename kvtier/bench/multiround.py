"""``kvtier bench multiround``: simulated multi-turn users against an OpenAI-compatible endpoint.

::

    kvtier bench multiround --url http://127.0.0.1:8000 --num-users 10 --num-rounds 5 \
        --shared-system-prompt 1000 --user-history-prompt 2000 --answer-len 100 --qps 0.5

Flags follow LMCache's multi-round QA benchmark; lengths are tokens. Closed loop by default
(``--concurrency`` users in flight, default all); ``--qps`` makes it open loop (Poisson). See
:mod:`kvtier.bench.workload` for the conversation shape, :mod:`kvtier.bench.figures` for the
figures and docs/benchmarks.md for a walk-through.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.runner import LoadConfig
from kvtier.bench.tokens import TokenCounter, counter_for
from kvtier.bench.workload import WorkloadConfig
from kvtier.demo.model import DEMO_NAME
from kvtier.errors import BackendUnavailableError, ConfigError


@dataclass(frozen=True)
class Options:
    """Everything one run needs, parsed from the command line once."""

    url: str
    model: str | None
    workload: WorkloadConfig
    load: LoadConfig
    api: str = "chat"
    stream: bool = True
    ignore_eos: bool = True
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 600.0
    user_header: str | None = None
    goodput: dict[str, float] = field(default_factory=dict)
    metrics_url: str | None = None
    tokenizer: str | None = None
    label: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("multiround", help="simulated multi-turn users against an "
                       "OpenAI-compatible endpoint (TTFT, ITL, throughput, hits per tier)")
    add_arguments(p)
    p.add_argument("--json", dest="json_path", help="write the run (figures and every "
                   "request) to this file")
    p.add_argument("--csv", dest="csv_path", help="write one row per request to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser, endpoint: bool = True, axes: bool = True) -> None:
    """The workload and load flags (shared with ``bench sweep``); ``endpoint``: also the
    flags naming the endpoint; ``axes``: also users and history length (a sweep's axes)."""
    d = WorkloadConfig()
    if endpoint:
        p.add_argument("--url", default="http://127.0.0.1:8000",
                       help="endpoint base URL (default: %(default)s)")
        p.add_argument("--model", help="served model name (default: the first of /v1/models)")
        p.add_argument("--tokenizer", help="local model dir or tokenizer.json to count tokens "
                       "(default: --model if it is a local dir; the demo model for "
                       f"{DEMO_NAME}; else 4 bytes per token)")
        p.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                       help="environment variable holding the API key (default: %(default)s)")
        p.add_argument("--api-key-file", metavar="FILE", help="file holding the API key")
        p.add_argument("--metrics-url", help="Prometheus endpoint of the server (default: "
                       "URL/metrics; 'none' to skip); several, comma-separated, are summed "
                       "(a fleet's instances and its router)")
        p.add_argument("--label", default="", help="name of this run in the results")
    g = p.add_argument_group("workload (lengths in tokens)")
    if axes:
        g.add_argument("--num-users", type=int, default=d.num_users)
    g.add_argument("--num-rounds", type=int, default=d.num_rounds)
    g.add_argument("--shared-system-prompt", type=int, default=d.system_prompt_tokens)
    if axes:
        g.add_argument("--user-history-prompt", type=int, default=d.user_history_tokens)
    g.add_argument("--question-len", type=int, default=d.question_tokens)
    g.add_argument("--answer-len", type=int, default=d.answer_tokens)
    g.add_argument("--long-fraction", type=float, default=d.long_fraction,
                   help="share of users with a long history (mixed long and short requests)")
    g.add_argument("--long-history-prompt", type=int, default=d.long_history_tokens)
    g.add_argument("--warmup-rounds", type=int, default=d.warmup_rounds,
                   help="each user's first rounds, run first and left out of the figures")
    g.add_argument("--dataset", choices=("synthetic", "sharegpt"), default=d.dataset)
    g.add_argument("--max-question-len", type=int, default=d.max_question_tokens,
                   help="sharegpt: cut longer questions")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--user-order", choices=("fixed", "shuffled"), default=d.user_order,
                   help="users speak in the same order every round, or each round in an "
                   "order of its own (seeded); measure fleets shuffled: in the fixed order a "
                   "round-robin router pins each user to one instance by accident")
    g = p.add_argument_group("load")
    g.add_argument("--qps", type=float, help="open loop: Poisson arrivals at this rate")
    g.add_argument("--concurrency", type=int, help="closed loop: requests in flight "
                   "(default: --num-users); with --qps: a cap (default none)")
    g.add_argument("--api", choices=("chat", "completions"), default="chat")
    g.add_argument("--no-stream", action="store_true", help="whole responses: no TTFT/ITL, "
                   "but vLLM then returns kvtier's per-tier accounting per request")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send vLLM's ignore_eos (answers may end early)")
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--user-header", help="send the user number in this HTTP header")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:SECONDS",
                   help="latency targets, e.g. ttft:2.0 itl:0.1 (also tpot, e2e)")


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_users=args.num_users, num_rounds=args.num_rounds,
        system_prompt_tokens=args.shared_system_prompt,
        user_history_tokens=args.user_history_prompt, question_tokens=args.question_len,
        answer_tokens=args.answer_len, long_fraction=args.long_fraction,
        long_history_tokens=args.long_history_prompt, warmup_rounds=args.warmup_rounds,
        dataset=args.dataset, max_question_tokens=args.max_question_len, seed=args.seed,
        user_order=args.user_order)


def load_config(args: argparse.Namespace) -> LoadConfig:
    if args.qps is not None:
        return LoadConfig("open", args.concurrency or 0, args.qps, args.seed)
    return LoadConfig("closed", args.concurrency or args.num_users, None, args.seed)


def options(args: argparse.Namespace) -> Options:
    from kvtier.bench.figures import parse_goodput

    goodput = parse_goodput(args.goodput)
    if args.no_stream and {"ttft", "itl", "tpot"} & set(goodput):
        raise ConfigError("--goodput ttft/itl/tpot need streaming (drop --no-stream)")
    metrics = args.metrics_url or f"{args.url.rstrip('/')}/metrics"
    return Options(
        url=args.url, model=args.model, workload=workload_config(args), load=load_config(args),
        api=args.api, stream=not args.no_stream, ignore_eos=not args.no_ignore_eos,
        api_key=api_key(args.api_key_env, args.api_key_file), timeout_s=args.request_timeout,
        user_header=args.user_header, goodput=goodput,
        metrics_url=None if metrics == "none" else metrics, tokenizer=args.tokenizer,
        label=args.label)


def api_key(env: str | None, file: str | None) -> str | None:
    """From the file if given, else the environment; never from the command line."""
    if file:
        try:
            return Path(file).expanduser().read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"--api-key-file: cannot read {file}: {exc}") from exc
    return os.environ.get(env) if env else None


def run(args: argparse.Namespace) -> int:
    from kvtier.bench.mr_output import print_table, write_csv, write_json

    opts = options(args)
    doc = execute(opts, progress=not args.no_progress)
    if args.json_path:
        write_json(doc, args.json_path)
    if args.csv_path:
        write_csv(doc["requests"], args.csv_path)
    s = doc["summary"]
    w = opts.workload
    print_table(s, f"kvtier bench multiround: {w.num_users} users x {w.num_rounds} rounds, "
                   f"{_load_text(opts.load)}, {doc['endpoint']['model']}")
    return 1 if s["requests"] and not s["ok"] else 0


def _load_text(load: LoadConfig) -> str:
    if load.mode == "open":
        return f"open loop {load.qps:g} req/s"
    return f"closed loop {load.concurrency} in flight"


def execute(opts: Options, progress: bool = True) -> dict[str, Any]:
    """Run the workload once and return the results document."""
    try:
        import httpx  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailableError("kvtier bench multiround needs httpx: "
                                      "pip install 'kvtier[bench]'") from exc
    return asyncio.run(_execute(opts, progress))


async def _execute(opts: Options, progress: bool) -> dict[str, Any]:
    from kvtier.bench import figures, prom, workload
    from kvtier.bench.machine import MachineWatch
    from kvtier.bench.mr_output import request_row
    from kvtier.bench.openai_client import Endpoint, EndpointConfig
    from kvtier.bench.runner import Runner

    model = opts.model or await _served_model(opts)
    counter = _counter(opts.tokenizer, model)
    dialogues = None
    if opts.workload.dataset == "sharegpt":
        from kvtier.bench.sharegpt import load_dialogues

        dialogues = load_dialogues(opts.workload.num_rounds, opts.workload.num_users,
                                   opts.workload.seed)
    wl = workload.build(opts.workload, counter, dialogues)
    config = EndpointConfig(url=opts.url, model=model, api="chat" if opts.api == "chat"
                            else "completions", stream=opts.stream,
                            ignore_eos=opts.ignore_eos, api_key=opts.api_key,
                            timeout_s=opts.timeout_s, user_header=opts.user_header)
    endpoint = Endpoint(config)
    scrape = None
    if opts.metrics_url:
        urls = [u.strip() for u in opts.metrics_url.split(",") if u.strip()]

        async def scrape() -> dict[str, float] | None:
            return await asyncio.to_thread(prom.scrape_all, urls)

    total = opts.workload.num_users * opts.workload.num_rounds
    with _progress(progress, total, opts.label or model) as on_result:
        runner = Runner(wl, endpoint, opts.load, counter, on_result, scrape)
        watch = MachineWatch(endpoint.now)
        watch.start()
        try:
            outcome = await runner.run()
        finally:
            machine = await watch.stop()
            await endpoint.close()
    measured = outcome.measured()
    before, after = outcome.counters_before, outcome.counters_after
    delta = prom.delta(before, after) if before is not None and after is not None else None
    summary = figures.summarize(measured, outcome.duration_s, opts.goodput, delta)
    return {
        "benchmark": "kvtier bench multiround",
        "version": 1,
        "label": opts.label,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "t0_unix": round(endpoint.t0_unix, 6),
        "machine": machine,
        "endpoint": {"url": opts.url, "model": model, "api": opts.api, "stream": opts.stream},
        "tokenizer": counter.name,
        "workload": dataclasses.asdict(opts.workload),
        "load": dataclasses.asdict(opts.load),
        "goodput_targets": opts.goodput,
        "metrics": figures.flat(summary),
        "summary": summary,
        "delayed_turns": outcome.delayed,
        "requests": [request_row(r) for r in sorted(outcome.results,
                                                    key=lambda r: (r.round, r.user))],
    }


async def _served_model(opts: Options) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            resp = await http.get(f"{opts.url.rstrip('/')}/v1/models", headers=headers)
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ConfigError(f"--model not given and {opts.url}/v1/models did not name one "
                          f"({exc})") from exc


def _counter(tokenizer: str | None, model: str) -> TokenCounter:
    if tokenizer:
        return counter_for(tokenizer)
    if Path(model).expanduser().is_dir():
        return counter_for(model)
    if model == DEMO_NAME:
        from kvtier.demo.model import demo_model_path

        return counter_for(str(demo_model_path()))
    return counter_for(None)


class _progress:
    """A rich progress bar advanced by each result (or nothing when off / rich missing)."""

    def __init__(self, on: bool, total: int, name: str) -> None:
        self.on, self.total, self.name = on and sys.stderr.isatty(), total, name
        self._bar: Any = None
        self._task: Any = None
        self.errors = 0

    def __enter__(self) -> Callable[[Any], None] | None:
        if not self.on:
            return None
        try:
            from rich.progress import Progress
        except ImportError:
            return None
        self._bar = Progress(transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.name, total=self.total)
        return self._advance

    def _advance(self, result: Any) -> None:
        self.errors += 0 if result.ok else 1
        phase = "warm-up" if result.warmup else "measured"
        self._bar.update(self._task, advance=1,
                         description=f"{self.name} [{phase}] errors {self.errors}")

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.cli import main as kvtier_main

    return kvtier_main(["bench", "multiround", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
