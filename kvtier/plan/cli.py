"""``kvtier plan``: size the device KV cache, the host headroom and the tiers, before serving.

::

    kvtier plan --model /models/llama-3-8b --device-memory 80GiB --tensor-parallel-size 1 \
        --max-model-len 32768 --gpu-memory-utilization 0.9 [--trace mooncake.jsonl] \
        [-o server.yaml] [--kustomize-patch plan-patch.yaml]

Prints the budgets (see :mod:`kvtier.plan.budget`), with ``--trace`` the four questions
answered (:mod:`kvtier.plan.traffic`), and a ``kvtier server --config`` YAML; optionally the
same sizes as a patch of the Kubernetes manifests (:mod:`kvtier.plan.kustomize`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.plan.budget import DeviceInputs, HostInputs
from kvtier.plan.model import read_model
from kvtier.plan.planner import DiskInputs, make_plan
from kvtier.plan.render import config_yaml, plan_text
from kvtier.trace.formats import FORMATS, MOONCAKE_BLOCK_TOKENS, load_trace


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="size device KV, host headroom and tiers from a model, "
                       "serving flags, the host and (optionally) a trace")
    p.add_argument("--model", required=True, help="model directory (or its config.json)")
    g = p.add_argument_group("serving (vLLM's flags)")
    g.add_argument("--device-memory", required=True, help="memory of one GPU, e.g. 80GiB")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--max-model-len", type=int, default=8192)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--kv-cache-dtype", default="auto")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--workspace", help="runtime workspace per GPU instead of the estimate")
    g.add_argument("--cpu-offload-gb", type=float, default=0.0,
                   help="vLLM's weight offloading per GPU (never counted as KV capacity)")
    g = p.add_argument_group("host")
    g.add_argument("--host-ram", help="RAM (default: MemTotal of /proc/meminfo)")
    g.add_argument("--os-reserve", help="for the OS (default: max(4GiB, 5%% of RAM))")
    g.add_argument("--page-cache", help="kept for the page cache (default: 10%% of RAM)")
    g.add_argument("--colocated", action="append", default=[], metavar="SIZE",
                   help="memory of a co-located service (repeatable)")
    g.add_argument("--engines", type=int, default=1, help="vLLM engines on this host")
    g.add_argument("--engine-host-memory", help="host memory of one engine's processes "
                   "(default: 2GiB + 4GiB per GPU)")
    g.add_argument("--margin", type=float, default=0.1, help="share kept free (default 0.1)")
    g = p.add_argument_group("disk")
    g.add_argument("--disk-path", default=None, help="disk tier folder (default: "
                   "~/.cache/kvtier/disk)")
    g.add_argument("--disk-size", help="disk tier size (default: --disk-share of the free "
                   "space)")
    g.add_argument("--disk-share", type=float, default=0.5)
    g = p.add_argument_group("trace")
    g.add_argument("--trace", help="Mooncake JSONL or a kvtier access log")
    g.add_argument("--trace-format", choices=FORMATS, default="auto")
    g.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS)
    g.add_argument("--transfer-gbps", type=float, default=20.0,
                   help="host-to-device transfer budget in GB/s (default 20)")
    g.add_argument("--target-share", type=float, default=0.9)
    g.add_argument("--max-hit-loss", type=float, default=0.01)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("-o", "--output", help="write the server config YAML here")
    p.add_argument("--json", dest="json_path", help="write the plan's figures as JSON")
    p.add_argument("--kustomize-patch", metavar="FILE",
                   help="write the sizes (arena, disk, memory, GPUs, gpu-memory-utilization) "
                   "as a kustomize patch of deploy/kubernetes' vLLM StatefulSet")
    p.set_defaults(func=run)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """Bytes of each ``/proc/meminfo`` field given in kB."""
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path} ({exc}); give --host-ram") from exc
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def _size(value: str | None, flag: str) -> int | None:
    return None if value is None else parse_size(value, flag)


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def run(args: argparse.Namespace) -> int:
    from kvtier.demo.model import default_cache_dir
    from kvtier.plan.budget import CPU_OFFLOAD_NOTE

    model = read_model(args.model, args.dtype)
    kv_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    device = DeviceInputs(
        device_bytes=parse_size(args.device_memory, "--device-memory"),
        gpu_memory_utilization=args.gpu_memory_utilization, tp=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, kv_dtype=kv_dtype,
        cpu_offload_gb=args.cpu_offload_gb, enforce_eager=args.enforce_eager,
        workspace_bytes=_size(args.workspace, "--workspace"))
    ram = _size(args.host_ram, "--host-ram")
    if ram is None:
        ram = meminfo()["MemTotal"]  # total, not a snapshot of what is free now
    host = HostInputs(ram_bytes=ram, os_bytes=_size(args.os_reserve, "--os-reserve"),
                      page_cache_bytes=_size(args.page_cache, "--page-cache"),
                      colocated_bytes=sum(parse_size(c, "--colocated") for c in args.colocated),
                      engines=args.engines,
                      engine_bytes=_size(args.engine_host_memory, "--engine-host-memory"),
                      margin=args.margin)
    disk_path = Path(args.disk_path).expanduser() if args.disk_path else (
        default_cache_dir() / "disk")
    disk = DiskInputs(str(disk_path), _free_bytes(disk_path), args.disk_share,
                      _size(args.disk_size, "--disk-size"))
    trace = None
    if args.trace:
        trace = load_trace(args.trace, args.trace_format, block_tokens=args.block_tokens)
    plan = make_plan(model, device, host, disk, args.chunk_tokens, trace, args.transfer_gbps,
                     args.target_share, args.max_hit_loss)
    print(plan_text(plan))
    text = config_yaml(plan)
    print("\n" + text, end="")
    if args.output:
        Path(args.output).write_text(text)
    if args.kustomize_patch:
        from kvtier.plan.kustomize import kustomize_patch

        Path(args.kustomize_patch).write_text(kustomize_patch(plan))
    if args.json_path:
        from kvtier.trace.report import write_json

        doc = {"model": plan.model, "device": plan.device, "host": plan.host,
               "disk_fit_bytes": plan.disk.fit_bytes, "arena_bytes": plan.arena_bytes,
               "disk_bytes": plan.disk_bytes, "config": plan.config,
               "cpu_offload_note": CPU_OFFLOAD_NOTE if args.cpu_offload_gb else None,
               "trace": None if plan.advice is None else {
                   "reach": plan.advice.reach, "arena_tokens": plan.advice.arena_tokens,
                   "disk_tokens": plan.advice.disk_tokens,
                   "admission": dict(plan.advice.admission)}}
        write_json(doc, args.json_path)
    return 0


def main() -> int:
    from kvtier.cli import main as kvtier_main

    return kvtier_main(["plan", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
