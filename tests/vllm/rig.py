"""A engine-free rig: the connector's scheduler and worker sides around fake KV caches.

``FakeEngine`` plays vLLM's part of the contract (admission, allocation, steps, worker
output aggregation) over real :class:`SchedulerSide` / :class:`WorkerSide` objects and a
real kvtier server, with tiny shapes. "Computing" a block writes a pattern derived from the
request's token prefix, layer and rank, so a block filled by a load can be compared with
what recomputing it would have produced.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.client import KvtierClient
from kvtier.keys import Namespace
from kvtier.vllm.config import ConnectorConfig, FaultConfig, RequestOptions
from kvtier.vllm.fencing import Reuse
from kvtier.vllm.kv_events import KvEventFeed
from kvtier.vllm.lanes import Lane
from kvtier.vllm.link import ServerLink
from kvtier.vllm.metadata import PayloadLayout, StepPlan, WorkerReport
from kvtier.vllm.scheduler import ScheduledReq, SchedulerSide, StepView
from kvtier.vllm.tracking import RequestInfo
from kvtier.vllm.worker import WorkerSide

BLOCK = 16
CHUNK = 32
LAYERS = 2
PAGE = 1024
NUM_BLOCKS = 64
_ids = itertools.count()


def layout(tp: int = 1) -> PayloadLayout:
    return PayloadLayout(LAYERS, tp, CHUNK // BLOCK, PAGE)


def namespace(tp: int = 1, model: str = "rig") -> Namespace:
    return Namespace(model=model, model_digest="0", dtype="uint8", num_layers=LAYERS,
                     num_kv_heads=1, head_dim=PAGE, block_size=BLOCK, kv_layout="rig",
                     chunk_tokens=CHUNK, tp_size=tp)


@dataclass(frozen=True)
class RigRequest:
    """What :class:`KvEventFeed` reads of vLLM's ``Request``."""

    request_id: str
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: None = None


def block_hashes(tokens: list[int]) -> list[bytes]:
    """A chained hash per full block, as vLLM computes ``request.block_hashes``."""
    out: list[bytes] = []
    parent = b"root"
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        parent = hashlib.sha256(parent + repr(tokens[start:start + BLOCK]).encode()).digest()
        out.append(parent)
    return out


def rig_request(req_id: str, tokens: list[int]) -> RigRequest:
    return RigRequest(req_id, block_hashes(tokens), list(tokens))


def block_pattern(tokens: tuple[int, ...], block: int, layer: int, rank: int) -> np.ndarray:
    seed = hashlib.sha256(repr((tokens[: (block + 1) * BLOCK], layer, rank)).encode()).digest()
    return np.resize(np.frombuffer(seed, dtype=np.uint8), PAGE)


@dataclass
class Req:
    info: RequestInfo
    blocks: list[int]
    computed: int = 0
    scheduled_once: bool = False
    loading: bool = False
    generated: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt and what was generated so far."""
        return self.info.tokens + tuple(self.generated)


@dataclass
class FakeEngine:
    socket: str
    tp: int = 1
    hold_loads_s: float = 0.0
    load_timeout_s: float = 5.0
    prefill_tokens_per_s: float = 0.0
    load_or_recompute: bool = True
    share_loads: bool = True
    lane: Callable[[], Lane] | None = None
    """Run the workers' staged (CUDA) copier on this lane instead of the CPU copier."""
    feed: Callable[[ServerLink], KvEventFeed] | None = None
    """Publish KV events through the feed this makes (see :func:`rig_request`)."""
    events: KvEventFeed | None = field(init=False, default=None)
    sched: SchedulerSide = field(init=False)
    workers: list[WorkerSide] = field(init=False)
    caches: list[dict[str, torch.Tensor]] = field(init=False)
    reqs: dict[str, Req] = field(default_factory=dict)
    free: list[int] = field(default_factory=lambda: list(range(1, NUM_BLOCKS)))
    failed_blocks: set[int] = field(default_factory=set)
    finished_loads: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        cfg = ConnectorConfig(server_socket=self.socket, chunk_tokens=CHUNK,
                              retry_interval_s=0.05, load_timeout_s=self.load_timeout_s,
                              prefill_tokens_per_s=self.prefill_tokens_per_s,
                              load_or_recompute=self.load_or_recompute,
                              share_loads=self.share_loads,
                              faults=FaultConfig(hold_loads_s=self.hold_loads_s))
        client = KvtierClient(self.socket, name="rig-scheduler", timeout_s=2.0)
        link = ServerLink(client, cfg.retry_interval_s)
        self.events = self.feed(link) if self.feed is not None else None
        self.sched = SchedulerSide(cfg, namespace(self.tp), layout(self.tp), BLOCK, link,
                                   chunks_seen=self.events.chunks_seen if self.events else None)
        self.caches, self.workers = [], []
        for rank in range(self.tp):
            cache = {f"model.layers.{i}.attn": torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8)
                     for i in range(LAYERS)}
            worker = WorkerSide(layout(self.tp), rank, NUM_BLOCKS,
                                KvtierClient(self.socket, name=f"rig-worker-{rank}"))
            worker.register(cache, lane=self.lane() if self.lane else None)
            self.caches.append(cache)
            self.workers.append(worker)

    # -------------------------------------------------------------- vLLM's role

    def add(self, tokens: list[int], *, local_blocks: int = 0, salt: str | None = None,
            **options: Any) -> str:
        """Admit a request (with ``local_blocks`` already in vLLM's own cache)."""
        req_id = f"req-{next(_ids)}"
        info = RequestInfo(req_id, tuple(tokens), (f"salt:{salt}",) if salt else (),
                           RequestOptions(**options))
        if self.events is not None:
            self.events.track(rig_request(req_id, tokens))
        self.sched.track(info)
        n = self.sched.num_new_matched_tokens(req_id, local_blocks * BLOCK)
        assert n == self.sched.num_new_matched_tokens(req_id, local_blocks * BLOCK)
        count = -(-len(tokens) // BLOCK)
        req = Req(info, [self.free.pop(0) for _ in range(count)], local_blocks * BLOCK + n)
        for b in range(local_blocks):
            self._compute_block(req, b)
        req.loading = n > 0
        self.reqs[req_id] = req
        self.sched.after_alloc(req_id, req.blocks, n)
        return req_id

    def hit(self, req_id: str) -> int:
        req = self.reqs[req_id]
        return req.computed

    def step(self, budget: int = 10_000) -> StepPlan:
        """One engine step: schedule runnable requests, run the workers, feed back."""
        scheduled = []
        for req_id, req in self.reqs.items():
            if req.loading or req.computed >= len(req.info.tokens):
                continue
            n = min(len(req.info.tokens) - req.computed, budget)
            scheduled.append(ScheduledReq(req_id, req.computed, n, not req.scheduled_once))
        # vLLM reports the blocks of requests scheduled for the first time as allocated.
        fresh = frozenset(b for s in scheduled if s.is_new for b in self.reqs[s.req_id].blocks)
        plan = self.sched.build_plan(StepView(scheduled, lambda r: self.reqs[r].blocks,
                                              Reuse(fresh)))
        for worker in self.workers:  # handle_preemptions: before the forward writes blocks
            worker.flush_stores(plan.flush)
        for s in scheduled:
            self.compute(self.reqs[s.req_id], s.num_computed, s.num_scheduled)
        self.run_workers(plan)
        return plan

    def run_workers(self, plan: StepPlan) -> None:
        report = WorkerReport()
        finished: set[str] | None = None
        for worker in self.workers:
            worker.start_loads(plan.loads)
            worker.save(plan.stores)
            done = worker.take_finished_loads()
            finished = done if finished is None else finished & done
            self.failed_blocks |= worker.take_failed_blocks()
            report = report.merge(worker.take_report() or WorkerReport())
        for req_id in finished or set():
            self._load_finished(req_id)
        self.sched.on_worker_output(finished or set(), report or None)

    def _load_finished(self, req_id: str) -> None:
        self.finished_loads.add(req_id)
        req = self.reqs.get(req_id)
        if req is None:
            return
        req.loading = False
        for i, block in enumerate(req.blocks):  # vLLM truncates at the first failed block
            if block in self.failed_blocks:
                req.computed = min(req.computed, i * BLOCK)
                break

    def compute(self, req: Req, start: int, n: int) -> None:
        req.scheduled_once = True
        for b in range(start // BLOCK, -(-(start + n) // BLOCK)):
            self._compute_block(req, b)
        req.computed = start + n

    def _compute_block(self, req: Req, b: int) -> None:
        for rank, cache in enumerate(self.caches):
            for layer, tensor in enumerate(cache.values()):
                tensor[req.blocks[b]] = torch.from_numpy(
                    block_pattern(req.tokens, b, layer, rank).copy())

    def decode(self, req_id: str, tokens: list[int]) -> None:
        """Generate ``tokens`` one step each, after the prompt: each step computes the KV
        of the token generated before it (vLLM's decode)."""
        req = self.reqs[req_id]
        for token in tokens:
            req.generated.append(token)
            while len(req.blocks) * BLOCK < len(req.tokens):
                req.blocks.append(self.free.pop(0))
            step = StepView([ScheduledReq(req_id, req.computed, 1, False)],
                            lambda r: self.reqs[r].blocks, Reuse(frozenset()),
                            lambda r: self.reqs[r].tokens)
            plan = self.sched.build_plan(step)
            self.compute(req, req.computed, 1)
            self.run_workers(plan)

    def finish(self, req_id: str, reason: str | None = "stop") -> dict[str, Any]:
        """End the request (as vLLM says it ended, with the tokens it generated); returns
        its ``kv_transfer_params["kvtier"]`` accounting."""
        params = self.sched.request_finished(req_id, reason, self.reqs[req_id].generated)
        if self.events is not None:
            self.events.untrack(req_id)
        req = self.reqs.pop(req_id)
        self.free += req.blocks
        assert params is not None, f"{req_id} was never admitted"
        return params["kvtier"]  # type: ignore[return-value]

    def run(self, req_id: str, steps: int = 50, load_timeout_s: float = 30.0,
            between: Callable[[], None] | None = None) -> None:
        """Step until ``req_id`` has computed its whole prompt: at most ``steps`` steps that
        compute, and while its load is in flight (a worker thread and the server, in their
        own time: a step here takes microseconds, so a busy machine could outlast any count
        of them) steps 5 ms apart for up to ``load_timeout_s``. ``between`` runs after each
        step (e.g. a fake stream catching up)."""
        deadline = time.monotonic() + load_timeout_s
        computing = 0
        while True:
            req = self.reqs[req_id]
            if not req.loading and req.computed >= len(req.info.tokens):
                return
            if req.loading:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{req_id}'s load did not finish in "
                                         f"{load_timeout_s} s")
                time.sleep(0.005)
            else:
                computing += 1
                if computing > steps:
                    raise AssertionError(f"{req_id} did not finish in {steps} steps")
            self.step()
            if between is not None:
                between()

    # -------------------------------------------------------------- checks

    def blocks_match_recompute(self, req_id: str, upto_block: int) -> bool:
        req = self.reqs[req_id]
        for rank, cache in enumerate(self.caches):
            for layer, tensor in enumerate(cache.values()):
                for b in range(upto_block):
                    want = block_pattern(req.tokens, b, layer, rank)
                    if not np.array_equal(tensor[req.blocks[b]].numpy(), want):
                        return False
        return True

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.sched.link.close()


def empty_step() -> Any:
    """A scheduler step that schedules nothing."""
    from kvtier.vllm.scheduler import StepView

    return StepView()


def step_for(engine: FakeEngine, req_id: str) -> Any:
    """A step that prefills the whole prompt of ``req_id`` (a new request)."""
    from kvtier.vllm.scheduler import ScheduledReq, StepView

    req = engine.reqs[req_id]
    return StepView([ScheduledReq(req_id, 0, len(req.info.tokens), True)],
                    lambda r: engine.reqs[r].blocks)
