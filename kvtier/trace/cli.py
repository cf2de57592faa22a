"""``kvtier trace analyze | simulate | generate | agents``: size the tiers from request traces.

``register(subparsers)`` adds the ``trace`` command to kvtier's CLI; each subcommand's
``func(args)`` returns the exit code. Errors kvtier raises on purpose (a malformed trace line,
a bad size) propagate as :class:`~kvtier.errors.KvtierError` for the top level to print.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policies import EVICTION, check_priority
from kvtier.trace.agentic import load_agentic
from kvtier.trace.analyze import Analysis, analyze
from kvtier.trace.formats import (
    FORMATS,
    MOONCAKE_BLOCK_TOKENS,
    Request,
    Trace,
    load_trace,
    write_mooncake,
)
from kvtier.trace.generate import GenConfig, generate
from kvtier.trace.hints import HINT_PRIORITY, apply_hints
from kvtier.trace.options import build_specs, parse_admission, parse_eviction, parse_tier
from kvtier.trace.recommend import Recommendation, recommend
from kvtier.trace.report import (
    analysis_text,
    recommendation_text,
    simulation_text,
    sweep_text,
    write_json,
)
from kvtier.trace.results import SimResult
from kvtier.trace.simulate import HOST, TierSpec, simulate
from kvtier.trace.sizes import bytes_per_token_from_model, show_tokens, size_chunks
from kvtier.trace.sweep import BELADY, SweepPoint, smallest_reaching, sweep


def register(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="analyze request traces and simulate tier sizes")
    commands = trace.add_subparsers(dest="trace_command", required=True)
    _add_analyze(commands)
    _add_simulate(commands)
    _add_generate(commands)
    _add_agents(commands)


def _add_input(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="trace: Mooncake JSONL or a kvtier access log")
    p.add_argument("--format", choices=FORMATS, default="auto", help="default: from line 1")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per Mooncake block (the access log names its own)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed lines, say how many")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--bytes-per-token", type=int, help="KV bytes per token (all layers, K+V)")
    kv.add_argument("--model", help="model directory (or config.json) to compute it from")
    p.add_argument("--kv-dtype", help="KV cache dtype if not the model's (e.g. fp8)")


def _add_analyze(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("analyze", help="sharing, reuse, hit ratio ceiling, KV bytes")
    _add_input(p)
    p.add_argument("--top", type=int, default=10, help="hottest prefixes to list")
    p.add_argument("--transfer-gbps", type=float, help="host transfer budget in GB/s")
    p.add_argument("--json", metavar="FILE", help="write the analysis as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="draw the distributions")
    p.set_defaults(func=run_analyze)


def _add_simulate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("simulate", help="replay through tiers of given sizes and policies")
    _add_input(p)
    p.add_argument("--tier", action="append", default=[],
                   metavar="NAME=SIZE[:OPT=V]",
                   help="host first, then lower tiers; SIZE like 3Mtok, 64GiB, inf; "
                        "OPT: eviction, admission, write (default with --sweep: host=inf)")
    p.add_argument("--eviction", default=None,
                   help=f"eviction policy of every tier: {', '.join(EVICTION)}; with --sweep a "
                        "comma list (default: all)")
    p.add_argument("--admission", default="always",
                   help="lower-tier admission, e.g. after_uses=2,min_prefix_tokens=2048")
    p.add_argument("--write-policy", choices=("through", "back"), default="through")
    p.add_argument("--sweep", metavar="SIZES", help="host sizes to sweep, e.g. 1Mtok,3Mtok,inf")
    p.add_argument("--plot", metavar="PNG", help="with --sweep: hit ratio against capacity")
    p.add_argument("--recommend", action="store_true",
                   help="smallest sizes and best admission for --target-share (replays more)")
    p.add_argument("--target-share", type=float, default=0.9,
                   help="share of the infinite-cache hit ratio to reach (default 0.9)")
    p.add_argument("--max-hit-loss", type=float, default=0.01,
                   help="hit ratio an admission rule may cost (default 0.01 = 1 point)")
    p.add_argument("--hints", default="trace", metavar="SOURCE",
                   help="retention hints: trace (its own fields), none, session[:TOOL_S,"
                        "STOP_S[,STOP_PRIORITY]] (the router's with --session-tool-tokens, set "
                        "when each answer ends by its stop reason: default 80 for 20 s after "
                        "tool calls, nothing after an end of turn), session-prev[:...] (the "
                        "router's without them: by the previous answer), router:TTL (retain "
                        "after tool calls for TTL s), continues:T (oracle: the session's next "
                        "request within T s)")
    p.add_argument("--hint-priority", type=int, default=HINT_PRIORITY,
                   help=f"priority derived hints retain at (after tool calls with session; "
                        f"default {HINT_PRIORITY})")
    p.add_argument("--json", metavar="FILE", help="write results as JSON ('-': stdout)")
    p.set_defaults(func=run_simulate)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="write a synthetic Mooncake-format trace")
    p.add_argument("-o", "--output", default="-", help="file to write ('-': stdout)")
    defaults = GenConfig()
    for name, value in vars(defaults).items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=type(value), default=value, help=f"default {value}")
    p.set_defaults(func=run_generate)


def _add_agents(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("agents", help="write Claude Code agent traces (kv-cache-tester's "
                                            "per-conversation JSON) as one Mooncake-format trace")
    p.add_argument("paths", nargs="+", help="trace files, or folders of *.json files")
    p.add_argument("-o", "--output", default="-", help="file to write ('-': stdout)")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="mean gap between conversation starts (exponential; default 0: "
                        "all start together)")
    p.add_argument("--seed", type=int, default=0, help="seed of the start gaps")
    p.set_defaults(func=run_agents)


def load(args: argparse.Namespace) -> Trace:
    trace = load_trace(args.file, args.format, block_tokens=args.block_tokens,
                       skip_bad=args.skip_bad)
    if trace.skipped:
        first = trace.skipped[0]
        print(f"skipped {len(trace.skipped)} malformed lines (first: {trace.source}:"
              f"{first.lineno}: {first.reason})", file=sys.stderr)
    return trace


def bytes_per_token(args: argparse.Namespace) -> int | None:
    if args.model:
        return bytes_per_token_from_model(args.model, args.kv_dtype)
    if args.bytes_per_token is not None and args.bytes_per_token <= 0:
        raise ConfigError("--bytes-per-token must be positive")
    return args.bytes_per_token


def run_analyze(args: argparse.Namespace) -> int:
    trace = load(args)
    analysis, dist = analyze(trace, bytes_per_token(args), top=args.top,
                             transfer_gbps=args.transfer_gbps)
    if args.json != "-":
        print(analysis_text(analysis))
    if args.json:
        write_json({"analysis": analysis, **_flat_hits(analysis)}, args.json)
    if args.plot:
        from kvtier.trace.plots import plot_analysis

        plot_analysis(dist, args.plot, Path(args.file).name)
    return 0


def _flat_hits(analysis: Analysis) -> dict[str, Any]:
    return {"block_hit_ratio": analysis.hits.block_hit_ratio,
            "token_hit_ratio": analysis.hits.token_hit_ratio}


def run_simulate(args: argparse.Namespace) -> int:
    trace = load(args)
    try:
        priority = check_priority(args.hint_priority)
    except ValueError as exc:
        raise ConfigError(f"--hint-priority: {exc}") from exc
    trace = dataclasses.replace(trace, requests=apply_hints(trace.requests, args.hints,
                                                            priority))
    bpt = bytes_per_token(args)
    policies = _policies(args)
    tiers = args.tier or (["host=inf"] if args.sweep else [])
    specs, explicit = build_specs(
        [parse_tier(t) for t in tiers],
        eviction=policies[0],
        admission=parse_admission(args.admission),
        write=args.write_policy,
        block_tokens=trace.block_tokens, bytes_per_token=bpt,
    )
    if args.sweep:
        return _run_sweep(args, trace, specs, explicit, policies, bpt)
    if len(policies) > 1:
        raise ConfigError("--eviction takes one policy unless --sweep is given")
    return _run_once(args, trace, specs, bpt)


def _policies(args: argparse.Namespace) -> list[str]:
    if args.eviction is None:
        return list(EVICTION) if args.sweep else ["lru"]
    return [parse_eviction(p.strip()) for p in args.eviction.split(",") if p.strip()]


def _run_once(
    args: argparse.Namespace, trace: Trace, specs: list[TierSpec], bpt: int | None
) -> int:
    block_bytes = trace.block_tokens * bpt if bpt else None
    result = simulate(trace.requests, specs, trace.block_tokens, block_bytes)
    rec = recommend(trace, specs, args.target_share, args.max_hit_loss) if args.recommend else None
    if args.json != "-":
        print(simulation_text(result, bpt))
        if rec is not None:
            print(recommendation_text(rec, trace.block_tokens, bpt))
    if args.json:
        write_json(_simulation_doc(trace, result, bpt, rec), args.json)
    return 0


def _simulation_doc(
    trace: Trace, result: SimResult, bpt: int | None, rec: Recommendation | None
) -> dict[str, Any]:
    c = result.counts
    return {
        "trace": _trace_doc(trace),
        "bytes_per_token": bpt,
        "block_bytes": result.block_bytes,
        "block_hit_ratio": c.block_hit_ratio,
        "token_hit_ratio": c.token_hit_ratio,
        "prompt_blocks": c.prompt_blocks,
        "prompt_tokens": c.prompt_tokens,
        "hit_blocks": c.hit_blocks,
        "hit_tokens": c.hit_tokens,
        "recomputed_tokens": c.recomputed_tokens,
        "tiers": {t.name: t for t in result.tiers},
        "replay": {"elapsed_s": result.elapsed_s, "accesses_per_s": result.accesses_per_s},
        "recommendation": rec,
    }


def _trace_doc(trace: Trace) -> dict[str, Any]:
    return {"source": trace.source, "format": trace.format, "requests": len(trace.requests),
            "block_accesses": trace.accesses, "block_tokens": trace.block_tokens,
            "skipped_lines": len(trace.skipped)}


def _run_sweep(
    args: argparse.Namespace,
    trace: Trace,
    specs: list[TierSpec],
    explicit: frozenset[str],
    policies: list[str],
    bpt: int | None,
) -> int:
    sizes = [size_chunks(s, trace.block_tokens, bpt, "--sweep") for s in args.sweep.split(",")]
    block_bytes = trace.block_tokens * bpt if bpt else None
    points = sweep(trace, specs, sizes, policies, explicit=explicit, block_bytes=block_bytes,
                   progress=_progress(trace.block_tokens))
    targets = _sweep_targets(trace, points, [*policies, BELADY], args.target_share)
    if args.json != "-":
        print(sweep_text(points, trace.block_tokens, bpt))
        print(_targets_text(targets, trace.block_tokens))
    if args.json:
        doc = {"trace": _trace_doc(trace), "bytes_per_token": bpt, "sweep": points,
               "recommendation": targets}
        write_json(doc, args.json)
    if args.plot:
        from kvtier.trace.plots import plot_sweep

        plot_sweep(points, trace.block_tokens, args.plot, Path(args.file).name)
    return 0


def _progress(block_tokens: int) -> Callable[[SweepPoint], None]:
    def show(point: SweepPoint) -> None:
        size = show_tokens(None if point.host_chunks is None else point.host_chunks * block_tokens)
        print(f"  {point.policy:>8} host={size:<10} block hit ratio "
              f"{point.block_hit_ratio:.4f} ({point.elapsed_s:.1f} s)", file=sys.stderr)

    return show


def _sweep_targets(
    trace: Trace, points: list[SweepPoint], policies: list[str], share: float
) -> dict[str, Any]:
    """The smallest swept host size per policy reaching ``share`` of the achievable ratio."""
    best = simulate(trace.requests, [TierSpec(HOST, None)], trace.block_tokens).block_hit_ratio
    smallest = {p: smallest_reaching(points, p, share * best) for p in policies}
    return {
        "target_share": share,
        "achievable_block_hit_ratio": best,
        "smallest_host_chunks": {p: None if s is None else s.host_chunks
                                 for p, s in smallest.items()},
        "reached": {p: s is not None for p, s in smallest.items()},
    }


def _targets_text(targets: dict[str, Any], block_tokens: int) -> str:
    share, best = targets["target_share"], targets["achievable_block_hit_ratio"]
    lines = [f"recommend  smallest swept host reaching {share:.0%} of the achievable "
             f"{best:.1%} block hit ratio ({share * best:.1%}):"]
    for policy, chunks in targets["smallest_host_chunks"].items():
        tokens = None if chunks is None else chunks * block_tokens
        found = show_tokens(tokens) if targets["reached"][policy] else "none of the swept sizes"
        lines.append(f"  {policy}: {found}")
    return "\n".join(lines)


def run_generate(args: argparse.Namespace) -> int:
    config = GenConfig(**{name: getattr(args, name) for name in vars(GenConfig())})
    _write(generate(config), args.output)
    return 0


def run_agents(args: argparse.Namespace) -> int:
    _write(load_agentic(args.paths, args.stagger_s, args.seed), args.output)
    return 0


def _write(requests: list[Request], output: str) -> None:
    if output == "-":
        write_mooncake(requests, sys.stdout)
    else:
        with open(output, "w", encoding="utf-8") as out:
            write_mooncake(requests, out)
    blocks = sum(len(r.blocks) for r in requests)
    print(f"wrote {len(requests):,} requests, {blocks:,} block accesses", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trace`` on its own: ``python -m kvtier.trace.cli analyze FILE``."""
    from kvtier.cli import main as kvtier_main

    return kvtier_main(["trace", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
