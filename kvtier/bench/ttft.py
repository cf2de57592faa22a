"""``kvtier bench ttft``: time to first token of one long prompt, by where its KV comes from.

For each of ``--repeats`` fresh prompts of ``--prompt-tokens`` tokens (default 8300), on one
vLLM engine with the kvtier connector (node server hosted by this process):

- recompute: first sight of the prompt (nothing cached anywhere; its chunks get stored);
- device: the same prompt again, from vLLM's own prefix cache;
- arena: vLLM's cache reset, the prompt's KV comes from kvtier's host-RAM arena;
- disk: the server restarted (arena empty) and the chunk files evicted from the page
  cache, the KV comes from the disk tier through the arena;
- shared (``--shared fs,s3``): a prompt computed with node A's server (arena + a shared tier
  only), then asked for through node B's server (an arena of its own, the same shared tier,
  at the engine's socket: the engine plays the second node's): ``ttft_shared_fs_s``,
  ``ttft_shared_s3_s`` (S3 is a SeaweedFS started on loopback).

TTFT is the wall time of a ``max_tokens=1`` request; medians are reported. Then the
throughput of unique prompts (no reuse possible) with the kvtier connector over the same
engine settings with no connector, and with a connector that does nothing
(:mod:`kvtier.vllm.noop`; vLLM itself runs differently once any connector is configured):
the same batches on each engine in turn (one engine alive at a time); each engine's best
batch counts, which keeps out most of the noise from other processes on the machine.
Targets: arena >= 5x faster than recompute and <= 1.5x the device hit; the connector costs
<= 5% throughput without reuse. With ``--lmcache``, the same prompts also go to LMCache's
multi-process server behind vLLM, from LMCache's own virtualenv (installed on first use; see
:mod:`kvtier.bench.ttft_lmcache`), into the same JSON. Also runs as
``python -m kvtier.bench.ttft``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from kvtier.bench import pagecache
from kvtier.bench.report import Row, print_table

TARGETS = {"arena_speedup_min": 5.0, "arena_over_device_max": 1.5, "throughput_ratio_min": 0.95}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ttft", help="TTFT recompute / device / arena / disk, and connector "
                       "overhead without reuse (starts vLLM engines)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model directory (default: the kvtier demo model)")
    p.add_argument("--prompt-tokens", type=int, default=8300)
    p.add_argument("--repeats", type=int, default=3, help="prompts per TTFT case (median)")
    p.add_argument("--dtype", default="auto", help="vLLM --dtype (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--throughput-prompts", type=int, default=8)
    p.add_argument("--throughput-tokens", type=int, default=2048)
    p.add_argument("--throughput-max-tokens", type=int, default=32)
    p.add_argument("--throughput-batches", type=int, default=4,
                   help="batches per engine, the same on both (the best time is kept)")
    p.add_argument("--dir", help="folder for the disk tier and socket (default: a temp dir)")
    p.add_argument("--json", dest="json_path", help="write the figures to this file")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    p.add_argument("--lmcache", action="store_true", help="also measure LMCache MP on the "
                   "same prompts (installs it into its own virtualenv on first use)")
    p.add_argument("--shared", default="fs,s3", help="shared tiers to serve a second node's "
                   "engine from: fs, s3 (SeaweedFS on loopback), or none (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from kvtier.demo import ensure_demo_model

    model = args.model or str(ensure_demo_model())
    # vLLM picks torch's thread count for the first engine of a process and exports it, so a
    # second engine would run with another: fix it up front, both engines get the same.
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-", dir=args.dir) as tmp:
        bench = _Bench(args, model, Path(tmp))
        try:
            figures = bench.measure()
        finally:
            bench.close()
    report(figures)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if not args.check or all(figures["targets_met"].values()) else 1


class _Bench:
    def __init__(self, args: argparse.Namespace, model: str, root: Path) -> None:
        self.args = args
        self.model = model
        self.root = root
        self.server: Any = None
        self.engines: list[Any] = []
        self.rng = random.Random(20240601)
        self.vocab = _vocab_size(model)
        self.prompts: list[list[int]] = []

    # ------------------------------------------------------------------ setup

    def _server_config(self) -> Any:
        from kvtier.launch.sizing import estimate_payload_len
        from kvtier.vllm.config import ConnectorConfig

        payload = estimate_payload_len(self.model, ["--dtype", self.args.dtype], 256)
        if payload is None:
            raise SystemExit(f"cannot size arena slots from {self.model}/config.json")
        chunks = self.args.prompt_tokens // 256 + 1
        server = {"socket_path": str(self.root / "kvtier.sock"), "log_level": "warning",
                  "arena": {"size_bytes": max(64, 4 * chunks) * (payload + 8192)},
                  "tiers": [{"type": "disk", "capacity_bytes": 64 * chunks * payload,
                             "options": {"path": str(self.root / "disk")}}]}
        return ConnectorConfig(server=server).server_config(payload)

    def _start_server(self) -> None:
        from kvtier.server import EmbeddedServer

        self.server = EmbeddedServer(self._server_config())
        self.server.start()

    def _engine(self, connector: str | None) -> Any:
        """An engine with no connector, the no-op control connector, or kvtier's."""
        from vllm import LLM
        from vllm.config import KVTransferConfig

        kw: dict[str, Any] = {}
        if connector == "kvtier":
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config={"server_socket": self.server.socket_path})
        elif connector == "noop":
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="NoopConnector", kv_connector_module_path="kvtier.vllm.noop",
                kv_role="kv_both")
        llm = LLM(model=self.model, dtype=self.args.dtype, enforce_eager=True,
                  max_model_len=self.args.max_model_len, kv_cache_memory_bytes=1 << 30,
                  enable_prefix_caching=True, seed=0, **kw)
        self.engines.append(llm)
        # Warm up at full length: the first long prefill of an engine pays for allocations.
        self._generate(llm, [self._prompt(self.args.prompt_tokens)], 4)
        return llm

    def _shutdown(self, llm: Any) -> None:
        llm.llm_engine.engine_core.shutdown()
        self.engines.remove(llm)

    def close(self) -> None:
        for llm in list(self.engines):
            self._shutdown(llm)
        if self.server is not None:
            self.server.stop(drain_s=5)

    # ------------------------------------------------------------------ measuring

    def measure(self) -> dict[str, Any]:
        self._start_server()
        n, size = self.args.throughput_prompts, self.args.throughput_tokens
        batches = [[self._prompt(size) for _ in range(n)]
                   for _ in range(self.args.throughput_batches)]
        times: dict[str, list[float]] = {}
        # One engine at a time: an idle engine's worker threads still compete for the cores.
        for name in ("none", "noop"):
            llm = self._engine(None if name == "none" else name)
            times[name] = [self._batch_time(llm, batch) for batch in batches]
            self._shutdown(llm)
        tiered = self._engine("kvtier")
        times["kvtier"] = [self._batch_time(tiered, batch) for batch in batches]
        ttft = self._ttft(tiered)
        shared = {f"shared_{name}": self._ttft_shared(tiered, name)
                  for name in self.args.shared.split(",") if name not in ("", "none")}
        lmcache = None
        if self.args.lmcache:
            from kvtier.bench import ttft_lmcache

            self._shutdown(tiered)  # one engine alive at a time
            lmcache = ttft_lmcache.measure(self.model, self.args.dtype,
                                           self.args.max_model_len, self.prompts,
                                           self.root / "lmcache")
        best = {name: min(t) for name, t in times.items()}
        tokens = n * (size + self.args.throughput_max_tokens)
        figures = _figures(self.args.prompt_tokens, ttft, best["none"] / best["kvtier"],
                           best["noop"] / best["kvtier"])
        for case, samples in shared.items():
            median = statistics.median(samples)
            figures[f"ttft_{case}_s"] = round(median, 4)
            figures[f"{case}_speedup"] = round(figures["ttft_recompute_s"] / median, 2)
            figures["ttft_samples_s"][case] = [round(x, 4) for x in samples]
        figures.update({f"throughput_{name}_tok_s": round(tokens / t, 1)
                        for name, t in best.items()})
        if lmcache is not None:
            figures.update(_lmcache_figures(lmcache, figures))
        figures["omp_threads"] = int(os.environ["OMP_NUM_THREADS"])
        figures["throughput_batch_s"] = {k: [round(t, 3) for t in v] for k, v in times.items()}
        return figures

    def _ttft(self, llm: Any) -> dict[str, list[float]]:
        cases: dict[str, list[float]] = {"recompute": [], "device": [], "arena": [], "disk": []}
        for _ in range(self.args.repeats):
            prompt = self._prompt(self.args.prompt_tokens)
            self.prompts.append(prompt)
            cases["recompute"].append(self._time(llm, prompt))
            self.server.store.flush(60)  # its chunks are on disk before the disk case
            cases["device"].append(self._time(llm, prompt))
            llm.reset_prefix_cache()
            cases["arena"].append(self._time(llm, prompt))
            self.server.stop(drain_s=30)
            pagecache.evict(self.root / "disk")
            self._start_server()
            llm.reset_prefix_cache()
            cases["disk"].append(self._time(llm, prompt))
        return cases

    def _ttft_shared(self, llm: Any, backend: str) -> list[float]:
        """A prompt computed on one node, then asked for on another node (a server with an
        arena of its own, at the engine's socket) that shares only the ``backend`` tier."""
        from kvtier.server import EmbeddedServer

        with contextlib.ExitStack() as stack:
            tier = self._shared_tier(backend, stack)
            config = msgspec.structs.replace(self._server_config(), tiers=(tier,))
            samples = []
            for _ in range(self.args.repeats):
                prompt = self._prompt(self.args.prompt_tokens)
                self.server.stop(drain_s=30)
                self.server = EmbeddedServer(config).start()  # node A
                llm.reset_prefix_cache()
                self._time(llm, prompt)
                self.server.store.flush(120)  # written through to the shared tier
                self.server.stop(drain_s=30)
                if backend == "fs":
                    pagecache.evict(self.root / "shared")  # node B's cache has none of it
                self.server = EmbeddedServer(config).start()  # node B: lists the shared tier
                llm.reset_prefix_cache()
                samples.append(self._time(llm, prompt))
            self.server.stop(drain_s=30)
            self.server = None
        self._start_server()
        return samples

    def _shared_tier(self, backend: str, stack: contextlib.ExitStack) -> Any:
        from kvtier.config import TierConfig

        options: dict[str, Any] = {"sweep_interval_s": 3600}
        if backend == "fs":
            options["path"] = str(self.root / "shared")
        elif backend == "s3":
            from kvtier.services import SeaweedFS

            weed = stack.enter_context(SeaweedFS())
            keys = self.root / "s3.keys"
            keys.write_text(f"AWS_ACCESS_KEY_ID={weed.credentials.access_key}\n"
                            f"AWS_SECRET_ACCESS_KEY={weed.credentials.secret_key}\n")
            keys.chmod(0o600)
            options.update(bucket="kvtier-ttft", endpoint_url=weed.endpoint, tls=False,
                           create_bucket=True, credentials=f"file:{keys}")
        else:
            raise SystemExit(f"--shared: unknown tier {backend!r}; allowed: fs, s3, none")
        return TierConfig(type=backend, name="shared", capacity_bytes=64 << 30, io_threads=4,
                          options=options)

    def _batch_time(self, llm: Any, batch: list[list[int]]) -> float:
        start = time.perf_counter()
        self._generate(llm, batch, self.args.throughput_max_tokens)
        return time.perf_counter() - start

    def _time(self, llm: Any, prompt: list[int]) -> float:
        start = time.perf_counter()
        self._generate(llm, [prompt], 1)
        return time.perf_counter() - start

    def _generate(self, llm: Any, batch: list[list[int]], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]


def _figures(prompt_tokens: int, ttft: dict[str, list[float]], ratio: float,
             ratio_noop: float) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in ttft.items()}
    figures: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        **{f"ttft_{k}_s": round(v, 4) for k, v in med.items()},
        "no_reuse_throughput_ratio": round(ratio, 4),
        "no_reuse_throughput_ratio_vs_noop": round(ratio_noop, 4),
        "ttft_samples_s": {k: [round(x, 4) for x in v] for k, v in ttft.items()},
        "arena_speedup": round(med["recompute"] / med["arena"], 2),
        "arena_over_device": round(med["arena"] / med["device"], 2),
        "disk_speedup": round(med["recompute"] / med["disk"], 2),
    }
    figures["targets"] = TARGETS
    floor = TARGETS["throughput_ratio_min"]
    figures["targets_met"] = {
        "arena_speedup": figures["arena_speedup"] >= TARGETS["arena_speedup_min"],
        "arena_over_device": figures["arena_over_device"] <= TARGETS["arena_over_device_max"],
        "no_reuse_throughput": ratio >= floor and ratio_noop >= floor,
    }
    return figures


def _lmcache_figures(cases: dict[str, list[float]], f: dict[str, Any]) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in cases.items()}
    return {
        "ttft_lmcache_recompute_s": round(med["recompute"], 4),
        "ttft_lmcache_device_s": round(med["device"], 4),
        "ttft_lmcache_hit_s": round(med["hit"], 4),
        "ttft_lmcache_samples_s": {k: [round(x, 4) for x in v] for k, v in cases.items()},
        "lmcache_speedup": round(med["recompute"] / med["hit"], 2),
        "lmcache_hit_over_arena": round(med["hit"] / f["ttft_arena_s"], 2),
        "lmcache_http_overhead_s": round(med["device"] - f["ttft_device_s"], 4),
    }


def report(f: dict[str, Any]) -> None:
    rows = [
        Row("ttft recompute (s)", f["ttft_recompute_s"], None, ""),
        Row("ttft device hit (s)", f["ttft_device_s"], f["ttft_recompute_s"], "recompute"),
        Row("ttft arena hit (s)", f["ttft_arena_s"], f["ttft_recompute_s"], "recompute"),
        Row("ttft arena hit (s)", f["ttft_arena_s"], f["ttft_device_s"], "device hit"),
        Row("ttft disk hit (s)", f["ttft_disk_s"], f["ttft_recompute_s"], "recompute"),
        *[Row(f"ttft {k[5:-2].replace('_', ' ')}, other node (s)", v, f["ttft_recompute_s"],
              "recompute") for k, v in f.items() if k.startswith("ttft_shared_")],
        Row("throughput, no reuse (tok/s)", f["throughput_kvtier_tok_s"],
            f["throughput_none_tok_s"], "no connector"),
        Row("throughput, no reuse (tok/s)", f["throughput_kvtier_tok_s"],
            f["throughput_noop_tok_s"], "no-op connector"),
    ]
    if "ttft_lmcache_hit_s" in f:
        rows += [
            Row("ttft LMCache MP recompute, HTTP (s)", f["ttft_lmcache_recompute_s"], None, ""),
            Row("ttft LMCache MP hit, HTTP (s)", f["ttft_lmcache_hit_s"],
                f["ttft_lmcache_recompute_s"], "its recompute"),
            Row("ttft arena hit (s)", f["ttft_arena_s"], f["ttft_lmcache_hit_s"],
                "LMCache MP hit"),
        ]
    print_table(rows, f"kvtier bench ttft: {f['prompt_tokens']}-token prompt")
    for name, ok in f["targets_met"].items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")


def _vocab_size(model: str) -> int:
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int((config.get("text_config") or config)["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 32000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.ttft",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
