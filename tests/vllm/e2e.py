"""Helpers for end-to-end tests with a real vLLM (CPU build) engine and kvtier server.

Engines use float32 and greedy sampling so a run served from the cache must produce exactly
the tokens of a run without it; a small device cache (``num_gpu_blocks_override``) makes
vLLM's own prefix cache forget quickly. Servers run as separate processes
(``python -m kvtier server``) so a test can SIGKILL one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.client import KvtierClient
from kvtier.errors import ClientError
from kvtier.tiers.arena import shm_path

MAX_MODEL_LEN = 10240
DEVICE_BLOCKS = 96  # 12288 tokens: the device cache cannot keep a round of prompts
BUDGET = 4096  # max_num_batched_tokens: a 9000-token prompt takes three steps
_arena_ids = itertools.count()


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1600) for _ in range(n)] for n in lengths]


LONG = prompts([9000, 3000, 2100], seed=1)
PREEMPT = prompts([2800, 2800, 2800, 2800], seed=2)
SHARED_1 = prompts([4000, 1500], seed=3)
SHARED_2 = prompts([2600, 3300], seed=4)
ABORTED = prompts([2000], seed=5)
CROSS = {case: prompts([2600, 1400], seed=10 + i)
         for i, case in enumerate(("fs", "fuse", "s3", "redis", "before_outage",
                                   "during_outage", "after_outage", "corrupt", "killed",
                                   "budget_a", "budget_b"))}
"""Per shared backend or fault: prompts stored by one node's engine, loaded by another's."""


@dataclass
class ServerProcess:
    """A ``kvtier server`` in its own process, restartable with other settings."""

    root: Path
    arena_bytes: int = 256 << 20
    disk_bytes: int = 2 << 30
    tiers: list[dict[str, Any]] | None = None
    """Lower tiers of the config (default: one disk tier under ``root``)."""
    socket_path: str = ""
    proc: subprocess.Popen[bytes] | None = None
    arena_name: str = ""
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket_path = self.socket_path or str(self.root / "kvtier.sock")
        self.log = self.root / "server.log"

    @property
    def disk_path(self) -> Path:
        return self.root / "disk"

    def start(self, **changes: Any) -> ServerProcess:
        for name, value in changes.items():
            setattr(self, name, value)
        self.arena_name = f"kvtier-e2e-{os.getpid()}-{next(_arena_ids)}"
        config = {
            "socket_path": self.socket_path, "log_format": "text",
            "arena": {"size_bytes": self.arena_bytes, "slot_bytes": 4096 + (1 << 20),
                      "name": self.arena_name},
            "tiers": self.tiers if self.tiers is not None else [
                {"type": "disk", "capacity_bytes": self.disk_bytes,
                 "options": {"path": str(self.disk_path)}}],
        }
        path = self.root / "server.yaml"
        path.write_text(yaml.safe_dump(config))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtier", "server", "--config",
                                          str(path)], stdout=log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(ClientError), KvtierClient(self.socket_path) as c:
                c.connect()
                return
            time.sleep(0.1)
        raise TimeoutError(f"kvtier server did not start: {self.log.read_text()[-2000:]}")

    def stats(self) -> dict[str, Any]:
        with KvtierClient(self.socket_path, name="e2e-test") as c:
            return c.stats()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would; then remove what a clean stop would have."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_path(self.arena_name))

    def restart(self, **changes: Any) -> ServerProcess:
        self.stop()
        return self.start(**changes)


def engine_args(server_socket: str | None, **extra: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; with a socket, the kvtier connector is attached."""
    args: dict[str, Any] = dict(
        dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=DEVICE_BLOCKS, max_num_batched_tokens=BUDGET,
        kv_cache_memory_bytes=256 << 20, enable_prefix_caching=True,
        disable_log_stats=False, seed=0,
    )
    if server_socket is not None:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"server_socket": server_socket,
                                       "retry_interval_s": 0.2, **extra})
    return args


def make_llm(model: str, server_socket: str | None, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(model=model, **engine_args(server_socket, **extra))


def close_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


@dataclass
class Result:
    tokens: list[list[int]]
    kvtier: list[dict[str, Any]]
    cached: list[int]


def generate(llm: Any, batch: list[list[int]], max_tokens: int = 8, **params: Any) -> Result:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"kvtier": params}} if params else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                        extra_args=extra)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp,
                        use_tqdm=False)
    return Result([list(o.outputs[0].token_ids) for o in outs],
                  [(o.kv_transfer_params or {}).get("kvtier", {}) for o in outs],
                  [o.num_cached_tokens for o in outs])


def one_by_one(llm: Any, batch: list[list[int]], max_tokens: int = 8) -> Result:
    parts = [generate(llm, [p], max_tokens) for p in batch]
    return Result([p.tokens[0] for p in parts], [p.kvtier[0] for p in parts],
                  [p.cached[0] for p in parts])


def metric(llm: Any, name: str) -> float:
    """Sum of a counter (name without ``_total``) over its label sets, from the snapshot."""
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics() if m.name == name)


def tier_tokens(acct: dict[str, Any], tier: str) -> int:
    return int(acct.get("tokens", {}).get(tier, 0))


def adds_up(acct: dict[str, Any], prompt: list[int]) -> bool:
    return acct.get("prompt_tokens") == len(prompt) == sum(acct.get("tokens", {}).values())


def engine_fixtures(name: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A module's ``server`` (a node server in a folder named ``name``) and ``llm`` (a vLLM
    engine connected to it) fixtures, each started once per module:
    ``server, llm = e2e.engine_fixtures("kvtier-...")``."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        proc = ServerProcess(tmp_path_factory.mktemp(name)).start()
        yield proc
        proc.stop()

    @pytest.fixture(scope="module")
    def llm(demo_model: str, server: ServerProcess) -> Iterator[Any]:
        engine = make_llm(demo_model, server.socket_path)
        yield engine
        close_llm(engine)

    return server, llm
