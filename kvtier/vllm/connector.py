"""``KvtierConnector``: vLLM's KV connector API on top of kvtier.

vLLM builds one instance in its EngineCore process (role SCHEDULER) and one in every worker
(role WORKER); they talk only through the per-step metadata. This facade translates vLLM's
objects and delegates: :class:`~kvtier.vllm.scheduler.SchedulerSide` plans loads and stores,
:class:`~kvtier.vllm.worker.WorkerSide` copies pages. Load it out of tree with
``kv_connector_module_path="kvtier.vllm"`` (see docs/vllm.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.client import KvtierClient
from kvtier.codec import HEADER_SIZE, align_up
from kvtier.vllm import identity
from kvtier.vllm.config import ConnectorConfig, RequestOptions
from kvtier.vllm.fencing import Reuse
from kvtier.vllm.kv_events import KvEventFeed
from kvtier.vllm.link import ServerLink
from kvtier.vllm.metadata import StepPlan, WorkerReport
from kvtier.vllm.scheduler import ScheduledReq, SchedulerSide, StepView
from kvtier.vllm.stats import KvtierPromMetrics, KvtierStats
from kvtier.vllm.tracking import RequestInfo
from kvtier.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


def _adopt_vllm_logging() -> None:
    # vLLM configures only its own logger; without this, kvtier's INFO lines (and the
    # embedded server's) are dropped in vLLM's processes.
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        ours.handlers = list(theirs.handlers)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


_adopt_vllm_logging()


class KvtierMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMeta:
        assert isinstance(other, KvtierWorkerMeta)
        return KvtierWorkerMeta(self.report.merge(other.report))


class KvtierConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = ConnectorConfig.from_extra_config(extra)
        self.layout, self.block_size = identity.payload_layout(
            vllm_config, kv_cache_config, self.cfg.chunk_tokens)
        self._server: Any = None
        self._events: KvEventFeed | None = None
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._requests: dict[str, Request] = {}
        """Requests being served, for their generated tokens (scheduler side)."""
        if role == KVConnectorRole.SCHEDULER:
            self._sched = self._make_scheduler_side()
        else:
            self._worker = self._make_worker_side()

    # ------------------------------------------------------------------ construction

    def _make_scheduler_side(self) -> SchedulerSide:
        if self.cfg.server is not None:
            self._server = _start_embedded(self.cfg, self.layout.payload_len)
        ns = identity.namespace(self._vllm_config, self._kv_cache_config,
                                self.cfg.chunk_tokens, self.cfg.model_id)
        client = KvtierClient(self.cfg.socket_path, name="vllm-scheduler",
                              timeout_s=self.cfg.client_timeout_s)
        link = ServerLink(client, self.cfg.retry_interval_s)
        log.info("kvtier connector (scheduler) on %s, namespace %s, chunk %d tokens = %d bytes",
                 self.cfg.socket_path, ns.short, self.cfg.chunk_tokens, self.layout.payload_len)
        _check_server(client, self.layout.payload_len)
        self._events = self._make_event_feed(link, ns.fingerprint)
        side = SchedulerSide(self.cfg, ns, self.layout, self.block_size, link,
                             info=_namespace_info(self._vllm_config),
                             chunks_seen=self._events.chunks_seen if self._events else None,
                             prefix_caching=bool(
                                 self._vllm_config.cache_config.enable_prefix_caching))
        side.register()
        return side

    def _make_event_feed(self, link: ServerLink, namespace_fp: bytes) -> KvEventFeed | None:
        """kvtier's tiers in vLLM's KV-event stream, when vLLM publishes one."""
        events = self._vllm_config.kv_events_config
        if events is None or not events.enable_kv_cache_events:
            return None
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

        groups = self._kv_cache_config.kv_cache_groups
        kind = get_kv_cache_spec_kind(groups[0].kv_cache_spec).value if groups else None
        return KvEventFeed(link, namespace_fp, self.block_size, self.cfg.chunk_tokens,
                           interval_s=self.cfg.kv_events_interval_s,
                           capacity=self.cfg.kv_events_chunks, spec_kind=kind)

    def _make_worker_side(self) -> WorkerSide:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank() if self.layout.tp_size > 1 else 0
        client = KvtierClient(self.cfg.socket_path, name=f"vllm-worker-{rank}",
                              timeout_s=self.cfg.client_timeout_s)
        return WorkerSide(self.layout, rank, self._kv_cache_config.num_blocks, client)

    @property
    def sched(self) -> SchedulerSide:
        assert self._sched is not None, "scheduler-side method called on a worker"
        return self._sched

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "worker-side method called on the scheduler"
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is only a future miss

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Request) -> None:
        self.sched.track(_request_info(request))
        self._requests[request.request_id] = request
        if self._events is not None:
            self._events.track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.sched.tracks(request.request_id):  # normally on_new_request did it
            self.on_new_request(request)
        n = self.sched.num_new_matched_tokens(request.request_id, num_computed_tokens)
        return n, n is not None and n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.sched.after_alloc(request.request_id, list(block_ids), num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        out: dict[CacheHitSource, int] = {}
        for tier, tokens in self.sched.hit_sources(request.request_id).items():
            source = _source(tier)
            out[source] = out.get(source, 0) + tokens
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KvtierMetadata(self.sched.build_plan(_step_view(scheduler_output,
                                                               self._tokens)))

    def _tokens(self, req_id: str) -> Sequence[int] | None:
        request = self._requests.get(req_id)
        return None if request is None else request.all_token_ids

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, KvtierWorkerMeta) else None
        self.sched.on_worker_output(set(connector_output.finished_recving or ()), report)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Stores read their blocks within the step (CPU), or finish before a forward that
        # reuses the blocks (CUDA: handle_preemptions flushes them), so vLLM may free the
        # blocks right away.
        if self._events is not None:
            self._events.untrack(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, self.sched.request_finished(request.request_id, _finish_reason(request),
                                                  request.output_token_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        # kvtier is shared and persistent: nothing is dropped, but this engine moves to a
        # new namespace generation, so KV computed before (e.g. older weights) never matches.
        sched = self.sched
        generation = int(sched.ns.extra.get("generation", "0")) + 1
        sched.ns = identity.namespace(self._vllm_config, self._kv_cache_config,
                                      self.cfg.chunk_tokens, self.cfg.model_id, generation)
        sched.reset_keys()
        if self._events is not None:
            self._events.renamespace(sched.ns.fingerprint)
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        # vLLM calls this once per step, after update_connector_output (so after this
        # step's commits); the feed reads the server's event log only when due.
        return self._events.take() if self._events is not None else ()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward, zeroing and block copies: wait for the stores whose
        # blocks vLLM reuses now (kvtier.vllm.fencing); the others keep running.
        if isinstance(kv_connector_metadata, KvtierMetadata):
            self.worker.flush_stores(kv_connector_metadata.plan.flush)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Also on empty steps (attn_metadata None): async loads are started there.
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtierMetadata) and meta.plan.loads:
            self.worker.start_loads(meta.plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before their request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole chunks are copied once, after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KvtierMetadata) and meta.plan.stores:
            self.worker.save(meta.plan.stores)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(finished_recving=self.worker.take_finished_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.take_report()
        return KvtierWorkerMeta(report) if report else None

    # ------------------------------------------------------------------ both sides

    def get_kv_connector_stats(self) -> KvtierStats | None:
        side = self._sched if self._sched is not None else self._worker
        data = side.take_counters() if side is not None else {}
        return KvtierStats(data) if data else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.link.close()
        if self._server is not None:
            self._server.stop()
            self._server = None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# ---------------------------------------------------------------------- translation


def _request_info(request: Request) -> RequestInfo:
    extras: list[str] = []
    if request.cache_salt:
        extras.append(f"salt:{request.cache_salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora:{lora.lora_name}:{getattr(lora, 'lora_path', '')}")
    # Multimodal prompts share placeholder tokens across different images: their KV is not
    # a function of the token ids, so they are never looked up or stored.
    cacheable = (request.prompt_token_ids is not None and request.prompt_embeds is None
                 and not getattr(request, "mm_features", None))
    return RequestInfo(
        req_id=request.request_id,
        tokens=tuple(request.prompt_token_ids or ()) if cacheable else (),
        extras=tuple(extras),
        options=RequestOptions.from_params(request.kv_transfer_params),
    )


def _scheduled(out: SchedulerOutput) -> Iterator[ScheduledReq]:
    n = out.num_scheduled_tokens
    for new in out.scheduled_new_reqs:
        yield ScheduledReq(new.req_id, new.num_computed_tokens, n.get(new.req_id, 0), True)
    cached = out.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        yield ScheduledReq(req_id, computed, n.get(req_id, 0), False)


def _step_view(out: SchedulerOutput,
               tokens: Callable[[str], Sequence[int] | None] = lambda _r: None) -> StepView:
    state = out.kv_connector_block_state

    def block_ids(req_id: str) -> list[int] | None:
        groups = state.get_block_ids(req_id) if state is not None else None
        return list(groups[0]) if groups else None

    return StepView(list(_scheduled(out)), block_ids, _reuse(out), tokens)


def _reuse(out: SchedulerOutput) -> Reuse:
    """Blocks this step hands out (new, resumed and grown requests) or writes before the
    forward (zeroing, block copies), and whether it preempted a request."""
    blocks: set[int] = set()
    for new in out.scheduled_new_reqs:
        for group in new.block_ids:
            blocks.update(group)
    for groups in out.scheduled_cached_reqs.new_block_ids:
        for group in groups or ():
            blocks.update(group)
    blocks.update(out.new_block_ids_to_zero or ())
    blocks.update(copy.dst_block_id for copy in out.kv_cache_block_copies or ())
    blocks.discard(0)  # the null block
    return Reuse(frozenset(blocks), bool(out.preempted_req_ids))


def _source(tier: str) -> CacheHitSource:
    if tier == "arena":
        return CacheHitSource.HOST
    if tier.startswith(("disk", "fs")):
        return CacheHitSource.DISK
    return CacheHitSource.EXTERNAL_UNSPECIFIED


def _namespace_info(vllm_config: VllmConfig) -> dict[str, str | int]:
    """What a router needs to compute this engine's keys: the tokenizer it uses and the
    name clients call the model by."""
    model = vllm_config.model_config
    served = model.served_model_name
    name = served[0] if isinstance(served, list | tuple) and served else served or model.model
    return {"served_model_name": str(name), "tokenizer": str(model.tokenizer or model.model)}


def _check_server(client: KvtierClient, payload_len: int) -> None:
    """Say at startup, not per request, when the server cannot help this engine."""
    from kvtier.errors import ClientError

    try:
        hello = client.connect()
    except ClientError as exc:
        log.warning("kvtier server not reachable yet (%s); serving by recompute until it is",
                    exc)
        return
    need = HEADER_SIZE + payload_len
    if hello.slot_bytes < need:
        log.error("kvtier arena slots are %d bytes but one chunk of this model needs %d: "
                  "nothing will be stored; restart the server with arena.slot_bytes >= %d "
                  "(or fewer chunk_tokens)", hello.slot_bytes, need, HEADER_SIZE
                  + align_up(payload_len))
    elif hello.slot_bytes >= 1.5 * need:
        log.warning("kvtier arena slots are %d bytes but one chunk of this model needs %d: "
                    "%.0f%% of the arena is never used; give the server arena.slot_bytes "
                    "= %d", hello.slot_bytes, need, 100 * (1 - need / hello.slot_bytes),
                    HEADER_SIZE + align_up(payload_len))


def _start_embedded(cfg: ConnectorConfig, payload_len: int) -> Any:
    """Start the embedded node server, unless one already answers on the socket."""
    from kvtier.errors import ClientError
    from kvtier.server import EmbeddedServer

    probe = KvtierClient(cfg.socket_path, name="vllm-probe", timeout_s=1.0)
    try:
        probe.connect()
        log.info("kvtier server already running on %s; using it", cfg.socket_path)
        return None
    except ClientError:
        pass
    finally:
        probe.close()
    server = EmbeddedServer(cfg.server_config(payload_len))
    server.start()
    return server


__all__ = ["KvtierConnector", "KvtierMetadata", "KvtierWorkerMeta"]


def _finish_reason(request: Request) -> str | None:
    """How the engine ended the request (``stop``, ``length``, ``abort``, ...), if it says."""
    reason = request.get_finished_reason()
    return None if reason is None else str(reason)
