"""The scheduler side: what to load, what to store, and keeping that honest.

Pure Python over a :class:`~kvtier.vllm.link.ServerLink`; the facade translates vLLM's
objects into :class:`RequestInfo` / :class:`StepView`, so this runs in tests without an engine.

Rules it keeps (vLLM 0.32's contract, see docs/vllm.md):

- A hit counts only chunks the server reports committed now, after vLLM's own prefix cache
  (``num_computed_tokens``, block aligned); only the blocks beyond it are loaded.
- Counting is side-effect free (vLLM may ask again); the lease is taken after allocation.
- Loads are always asynchronous: the request waits in WAITING_FOR_REMOTE_KVS until a worker
  reports it, which it always does, also for a failed, late or aborted load.
- A chunk that cannot be served (vanished, corrupt, promotion late, server down) is reported
  as failed blocks; vLLM (``kv_load_failure_policy="recompute"``) recomputes from there.
- Forks: a request whose prefix another request of this engine is loading waits for that
  load (``None``: vLLM asks again) and then shares its blocks through vLLM's prefix cache
  (:mod:`kvtier.vllm.shared_loads`).
- Load or recompute: the tail of a hit that would arrive later than recomputing it is not
  loaded (:mod:`kvtier.vllm.recompute`); its tokens are counted as skipped, by tier.
- Stores: each step, the full prompt chunks that step computes are reserved (not those the
  request loaded from kvtier: they are there); workers copy them after the forward; a chunk
  is committed once every rank confirmed it, else aborted. Chunks of generated tokens too,
  for a request whose retention has a ``decode_priority`` (kept at it) or with
  ``store_generated``: the next turn of a conversation starts with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.hints import RELEASED, ChunkRetention, chunk_retentions, runs
from kvtier.keys import ChunkKey, Namespace, chunk_keys
from kvtier.protocol import (
    Abort,
    Commit,
    Lease,
    LeaseReply,
    Lookup,
    Register,
    Release,
    Report,
    Reserve,
    SetPriority,
)
from kvtier.vllm.config import ConnectorConfig
from kvtier.vllm.counters import Counters
from kvtier.vllm.fencing import Reuse, StoreFences
from kvtier.vllm.link import ServerLink
from kvtier.vllm.loads import chunk_loads, make_job, readiness
from kvtier.vllm.metadata import LoadJob, PayloadLayout, StepPlan, StoreJob, WorkerReport
from kvtier.vllm.recompute import PrefillMeter, choose
from kvtier.vllm.shared_loads import SharedLoads
from kvtier.vllm.tracking import (
    Accounting,
    ChunkLoad,
    HitPlan,
    LoadState,
    ReqState,
    RequestInfo,
)

ChunksSeen = Callable[[str, int, list[ChunkKey]], None]
"""(request id, index of the first chunk, keys): chunks a request stores or loads."""
REPORT_EVERY_S = 1.0
"""How often the scheduler side adds its counters to the node server's /metrics."""


@dataclass(frozen=True)
class ScheduledReq:
    req_id: str
    num_computed: int
    """Tokens computed before this step."""
    num_scheduled: int
    is_new: bool
    """First time scheduled (vLLM's scheduled_new_reqs)."""


@dataclass
class StepView:
    scheduled: list[ScheduledReq] = field(default_factory=list)
    block_ids: Callable[[str], list[int] | None] = lambda _req_id: None
    reuse: Reuse = field(default_factory=Reuse)
    """Blocks vLLM hands out or overwrites this step (for :mod:`kvtier.vllm.fencing`)."""
    tokens: Callable[[str], Sequence[int] | None] = lambda _req_id: None
    """A request's token ids so far, prompt and generated (``None``: its prompt only)."""


@dataclass
class _Pending:
    req_id: str
    confirmations: int = 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, layout: PayloadLayout,
                 block_size: int, link: ServerLink,
                 clock: Callable[[], float] = time.monotonic,
                 info: dict[str, str | int] | None = None,
                 chunks_seen: ChunksSeen | None = None, prefix_caching: bool = True) -> None:
        self.cfg = config
        self.ns = namespace
        self.layout = layout
        self.block_size = block_size
        self.chunk_tokens = config.chunk_tokens
        self.link = link
        self.clock = clock
        self.counters = Counters()
        self.prefill = PrefillMeter(min_tokens=config.chunk_tokens)
        self._reqs: dict[str, ReqState] = {}
        self._loads: dict[str, ReqState] = {}
        self._pending: dict[bytes, _Pending] = {}
        self.shared = SharedLoads(config.load_timeout_s, config.share_loads and prefix_caching)
        """Loads in flight here, that requests for the same prefix wait for."""
        self.fences = StoreFences()
        self._link_failures_seen = 0
        self._reported_at = 0.0
        self.info = {"model": namespace.model, "chunk_tokens": config.chunk_tokens,
                     "block_size": block_size, **(info or {})}
        """What the node server is told about this namespace (Register)."""
        self._registered: str | None = None
        self.chunks_seen = chunks_seen
        """Told which chunks of a request are stored or leased (the KV-event feed)."""

    # ------------------------------------------------------------------ admission

    def track(self, info: RequestInfo) -> None:
        self._reqs.setdefault(info.req_id, ReqState(info))

    def tracks(self, req_id: str) -> bool:
        return req_id in self._reqs

    def num_new_matched_tokens(self, req_id: str, num_computed: int) -> int | None:
        """Tokens kvtier can serve beyond ``num_computed`` (0 if none; ``None``: ask again
        later, another request is loading this one's prefix). No side effects beyond
        remembering the answer for :meth:`after_alloc`."""
        st = self._reqs.get(req_id)
        if st is None:
            return 0
        st.plan, st.asked_at = None, num_computed
        if st.load_failed or not (self.cfg.load and st.info.options.load and st.info.tokens):
            return 0
        keys = self._keys(st)
        start = num_computed // self.chunk_tokens
        if start >= len(keys):
            return 0
        waits = self.shared.wait(req_id, keys[start], self.clock())
        if waits is not None:
            if waits:
                self.counters.add("shared_load_waits")
            return None
        if not st.looked_up:  # vLLM asks again while the request waits: counted once
            st.looked_up = True
            self.counters.add("query_tokens", len(st.info.tokens) - num_computed)
        reply = self.link.call(Lookup(keys[start:], self.ns.short, len(st.info.tokens),
                                      self.chunk_tokens), None)
        if reply is None or not reply.tiers:
            return 0
        choice = choose(reply.tiers, reply.arrival_s, start_chunk=start,
                        local_tokens=num_computed, chunk_tokens=self.chunk_tokens,
                        prefill_tokens_per_s=self._prefill_speed())
        plan = HitPlan(num_computed, start, choice.tiers, choice.skipped)
        if plan.hit_tokens(self.chunk_tokens) <= 0:
            if plan.skipped:  # nothing worth loading: remembered for the request's books
                st.plan = plan
            return 0
        st.plan = plan
        return plan.hit_tokens(self.chunk_tokens)

    def _prefill_speed(self) -> float | None:
        if not self.cfg.load_or_recompute:
            return None
        return self.cfg.prefill_tokens_per_s or self.prefill.tokens_per_s()

    def after_alloc(self, req_id: str, block_ids: list[int], num_external: int) -> None:
        """vLLM allocated blocks; with ``num_external > 0`` lease and plan the load."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        plan, st.plan = st.plan, None
        first = st.accounting is None
        if first:
            st.accounting = Accounting(len(st.info.tokens))
        if plan is not None and plan.skipped:
            self._count_skipped(st, plan, account=first)
        if num_external == 0:
            if first:
                st.accounting.device_from_schedule = True  # type: ignore[union-attr]
            return
        now = self.clock()
        if plan is None or plan.hit_tokens(self.chunk_tokens) != num_external:
            self._unplanned_load(st, block_ids, num_external, now, first)
            return
        lease = self._lease(st, plan)
        st.load = LoadState(
            lease.lease_id if lease else None,
            (self.link.arena_name() if lease else None) or "",
            chunk_loads(plan, lease, block_ids, self.block_size, self.layout.blocks_per_chunk),
            bool(lease and lease.ready), now + self.cfg.load_timeout_s,
            now + self.cfg.faults.hold_loads_s, account=first)
        self._loads[req_id] = st
        keys = self._keys(st)
        self.shared.started(req_id, [keys[c.index] for c in st.load.chunks if c.slot is not None])
        if first:
            st.accounting.device = plan.local_tokens  # type: ignore[union-attr]
            for chunk in st.load.chunks:  # what kvtier provides beyond vLLM's own hit
                if chunk.slot is not None:
                    self.counters.add("hit_tokens", len(chunk.block_ids) * self.block_size,
                                      chunk.tier)

    def _unplanned_load(self, st: ReqState, block_ids: list[int], num_external: int,
                        now: float, first: bool) -> None:
        """vLLM wants a load we did not plan: fail the blocks of the external tokens (not
        vLLM's own prefix blocks, which running requests may share); vLLM recomputes them."""
        local = st.asked_at or 0
        first_block = local // self.block_size
        end_block = -(-(local + num_external) // self.block_size)
        blocks = list(block_ids[first_block:end_block])
        failed = [ChunkLoad(0, None, "none", blocks, [0] * len(blocks))]
        st.load = LoadState(None, "", failed, False, now, now, account=first)
        self._loads[st.req_id] = st
        if first:
            st.accounting.device = local  # type: ignore[union-attr]

    def _count_skipped(self, st: ReqState, plan: HitPlan, account: bool) -> None:
        for tier, tokens in plan.skipped.items():
            self.counters.add("skipped_slower_than_recompute", tokens, tier)
            if account and st.accounting is not None:
                skipped = st.accounting.skipped
                skipped[tier] = skipped.get(tier, 0) + tokens

    def _lease(self, st: ReqState, plan: HitPlan) -> LeaseReply | None:
        if not plan.tiers:
            return None
        keys = self._keys(st)[plan.start_chunk : plan.start_chunk + len(plan.tiers)]
        if self.chunks_seen is not None:
            self.chunks_seen(st.req_id, plan.start_chunk, keys)
        return self.link.call(Lease(keys), None)

    def hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the planned load by tier (for vLLM's cached-by-source metric)."""
        st = self._reqs.get(req_id)
        out: dict[str, int] = {}
        if st is None or st.load is None:
            return out
        for chunk in st.load.chunks:
            out[chunk.tier] = out.get(chunk.tier, 0) + len(chunk.block_ids) * self.block_size
        return out

    # ------------------------------------------------------------------ steps

    def build_plan(self, step: StepView) -> StepPlan:
        plan = StepPlan()
        now = self.clock()
        self.prefill.step(now, sum(sr.num_scheduled for sr in step.scheduled))
        for st in list(self._loads.values()):
            job = self._try_emit(st, now)
            if job is not None:
                plan.loads.append(job)
        self._device_hits(step)
        plan.flush = self.fences.flush(step.reuse)
        plan.stores = self._stores(step)
        self.fences.add(plan.stores)
        self._count_link_failures()
        self._report(now)
        return plan

    def _report(self, now: float, force: bool = False) -> None:
        """Tell the node server what this engine saw: at most once per REPORT_EVERY_S while
        steps run, and when the last running request finishes (an idle engine stops
        stepping). A server seen for the first time (a new start) is told about this
        namespace first."""
        if (now - self._reported_at < REPORT_EVERY_S and not force) or not self.link.available:
            return
        self._reported_at = now
        self.register()
        counters = self.counters.take_unreported()
        if counters:
            self.link.call(Report(f"vllm-{self.ns.short[:8]}", counters), None)

    def _try_emit(self, st: ReqState, now: float) -> LoadJob | None:
        load = st.load
        if load is None or load.emitted:
            return None
        if load.cancelled:
            load.emitted = True
            self.counters.add("cancelled_loads")
            return LoadJob(st.req_id, load.arena)  # nothing to copy: only report it done
        if now < load.hold_until:
            return None
        ready = readiness(load, self.link, now)
        if ready is None:
            return None
        load.emitted = True
        job = make_job(st.req_id, load, ready, self.block_size)
        self._account_load(st, load)
        return job

    def _account_load(self, st: ReqState, load: LoadState) -> None:
        st.load_failed = st.load_failed or load.failed > 0
        st.in_kvtier.update(load.served)  # not reserved again (unless the worker fails it)
        for tier, tokens in load.loaded.items():
            self.counters.add("loaded_tokens", tokens, tier)
        self.counters.add("failed_load_tokens", load.failed)
        if load.account and st.accounting is not None:
            for tier, tokens in load.loaded.items():
                st.accounting.by_tier[tier] = st.accounting.by_tier.get(tier, 0) + tokens
            st.accounting.failed_load += load.failed

    def _device_hits(self, step: StepView) -> None:
        for sr in step.scheduled:
            st = self._reqs.get(sr.req_id)
            acc = st.accounting if st is not None else None
            if sr.is_new and acc is not None and acc.device_from_schedule:
                acc.device, acc.device_from_schedule = sr.num_computed, False

    def _stores(self, step: StepView) -> list[StoreJob]:
        if not self.cfg.store:
            return []
        jobs: list[StoreJob] = []
        bpc = self.layout.blocks_per_chunk
        for sr in step.scheduled:
            st = self._reqs.get(sr.req_id)
            if st is None or not st.info.tokens or not st.info.options.store:
                continue
            tokens = self._stored_tokens(st, step)
            done = min(sr.num_computed + sr.num_scheduled, len(tokens))
            end = done // self.chunk_tokens
            if end <= st.stored_upto:
                continue
            block_ids = step.block_ids(sr.req_id)
            if block_ids is None:
                continue
            end = min(end, len(block_ids) // bpc)
            start, st.stored_upto = st.stored_upto, max(st.stored_upto, end)
            keys = self._keys_upto(st, end, tokens)
            for lo, hi in _runs_outside(start, end, st.in_kvtier):
                jobs += self._reserve(st, lo, hi, block_ids, keys)
        return jobs

    def _stored_tokens(self, st: ReqState, step: StepView) -> Sequence[int]:
        """The tokens whose full chunks the request stores: its prompt, and what it
        generated if it asked to keep that (or the connector stores it for all)."""
        hint = st.info.options.retention
        if not (self.cfg.store_generated or (hint is not None
                                             and hint.decode_priority is not None)):
            return st.info.tokens
        return step.tokens(st.req_id) or st.info.tokens

    def _reserve(self, st: ReqState, start: int, end: int, block_ids: list[int],
                 keys: list[ChunkKey]) -> list[StoreJob]:
        """Reserve chunks [start, end): one call per run of equal retention."""
        jobs: list[StoreJob] = []
        for lo, hi, retention in runs(self._retentions(st, len(keys)), start, end):
            jobs += self._reserve_run(st, keys[lo:hi], lo, block_ids, retention)
        return jobs

    def _reserve_run(self, st: ReqState, keys: list[ChunkKey], start: int,
                     block_ids: list[int], retention: ChunkRetention) -> list[StoreJob]:
        if not keys:
            return []
        if self.chunks_seen is not None:
            self.chunks_seen(st.req_id, start, keys)
        # If the reply is lost, abort what it may have reserved (not other requests' stores).
        mine = [k for k in keys if k not in self._pending]
        undo = Abort(mine) if mine else None
        priority, retain_s = retention
        reply = self.link.call(Reserve(self.ns.fingerprint, keys, self.layout.payload_len,
                                       self.chunk_tokens, priority, start, retain_s,
                                       st.info.options.tenant), None,
                               undo=undo)
        slots = reply.slots if reply is not None else [None] * len(keys)
        granted = [(start + i, k, s) for i, (k, s) in enumerate(zip(keys, slots, strict=True))
                   if s is not None]
        self.counters.add("skipped_store_chunks", len(keys) - len(granted))
        arena = self.link.arena_name() if granted else None
        if granted and arena is None:
            self.link.call(Abort([k for _, k, _ in granted]), None)
            return []
        bpc = self.layout.blocks_per_chunk
        jobs = []
        for c, key, slot in granted:
            jobs.append(StoreJob(key, slot, arena or "", block_ids[c * bpc : (c + 1) * bpc]))
            self._pending[key] = _Pending(st.req_id)
        if st.accounting is not None:
            st.accounting.stored_chunks += len(jobs)
        return jobs

    # ------------------------------------------------------------------ worker output

    def on_worker_output(self, finished_loads: set[str], report: WorkerReport | None) -> None:
        if report is not None:
            for req_id in report.failed_loads:  # before _load_done drops the load state
                self._load_failed_in_worker(req_id)
        for req_id in finished_loads:
            self._load_done(req_id)
        if report is not None:
            self._settle_stores(report)
            self.fences.retain(self._pending)
        self._count_link_failures()

    def _load_done(self, req_id: str) -> None:
        st = self._loads.pop(req_id, None)
        self.shared.ended(req_id)
        if st is None or st.load is None:
            return
        if st.load.lease_id is not None:
            self.link.call(Release(st.load.lease_id), None)
        st.load = None
        if st.finished:
            self._reqs.pop(req_id, None)

    def _load_failed_in_worker(self, req_id: str) -> None:
        st = self._reqs.get(req_id)
        if st is None or st.load is None:
            return
        st.load_failed = True
        load, acc = st.load, st.accounting
        # The worker copied none of it: what was counted as loaded is recomputed (and
        # stored again).
        st.in_kvtier.difference_update(load.served)
        lost = sum(load.loaded.values())
        self.counters.add("failed_load_tokens", lost)
        if load.account and acc is not None:
            for tier, tokens in load.loaded.items():
                acc.by_tier[tier] = acc.by_tier.get(tier, 0) - tokens
            acc.by_tier = {t: n for t, n in acc.by_tier.items() if n > 0}
            acc.failed_load += lost
        load.loaded = {}

    def _settle_stores(self, report: WorkerReport) -> None:
        tp = self.layout.tp_size
        commit: list[ChunkKey] = []
        for key in report.stored:
            pending = self._pending.get(key)
            if pending is None:
                continue
            pending.confirmations += 1
            if pending.confirmations >= tp:
                del self._pending[key]
                commit.append(ChunkKey(key))
        failed = [ChunkKey(k) for k in dict.fromkeys(report.failed) if k in self._pending]
        for key in failed:
            del self._pending[key]
        if commit:
            reply = self.link.call(Commit(commit), None)
            self.counters.add("stored_chunks", reply.count if reply is not None else 0)
        if failed:
            self.counters.add("failed_store_chunks", len(failed))
            self.link.call(Abort(failed), None)

    # ------------------------------------------------------------------ end of a request

    def request_finished(self, req_id: str, reason: str | None = None,
                         generated: Sequence[int] = ()) -> dict[str, object] | None:
        """The request is done (``reason``: how it ended, one of
        :data:`~kvtier.hints.FINISH_REASONS`, if known; ``generated``: its answer's token
        ids, which tell a tool call where the request says what marks one): its accounting
        for kv_transfer_params, and cleanup."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        st.finished = True
        if st.load is None:
            self.shared.ended(req_id)
        if st.load is not None and not st.load.emitted:
            st.load.cancelled = True  # the worker must still report it (vLLM holds blocks)
        if st.load is None:
            del self._reqs[req_id]
        self._retain_at_finish(st, reason, generated)
        # A report is a round trip to the node server inside vLLM's scheduler loop. An
        # engine that still runs other requests keeps stepping, and the periodic report
        # carries this one's counters within REPORT_EVERY_S; only one about to go idle
        # reports now. (Forced at every finish, every finish waited for the node server's
        # answer, milliseconds on busy cores, before vLLM could schedule the next step.)
        still_running = any(not other.finished for other in self._reqs.values())
        self._report(self.clock(), force=not still_running)
        return None if st.accounting is None else {"kvtier": st.accounting.as_params()}

    def reset_keys(self) -> None:
        """The namespace changed: recompute every tracked request's keys on next use."""
        for st in self._reqs.values():
            st.keys = None
        self._registered = None

    def register(self) -> None:
        """Describe this namespace to the server once per server start."""
        server = self.link.arena_name()
        if server is None or server == self._registered:
            return
        info = {**self.info, "namespace": self.ns.short}
        if self.link.call(Register(self.ns.fingerprint, info), None) is not None:
            self._registered = server

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._pending)

    def take_counters(self) -> dict[str, float]:
        self._count_link_failures()
        return self.counters.take()

    def _count_link_failures(self) -> None:
        new = self.link.failures - self._link_failures_seen
        self._link_failures_seen = self.link.failures
        self.counters.add("server_unavailable", new)

    # ------------------------------------------------------------------ helpers

    def _keys(self, st: ReqState) -> list[ChunkKey]:
        if st.keys is None:
            st.keys = chunk_keys(self.ns.fingerprint, st.info.tokens, self.chunk_tokens,
                                 st.info.extras)
        return st.keys

    def _priority(self, st: ReqState) -> int:
        p = st.info.options.priority
        return self.cfg.priority if p is None else p

    def _keys_upto(self, st: ReqState, end: int, tokens: Sequence[int]) -> list[ChunkKey]:
        """Keys of chunks [0, end) of ``tokens`` (the prompt's, and beyond it generated
        tokens'; remembered for the retention at finish)."""
        keys = self._keys(st)
        if end <= len(keys):
            return keys
        known = st.generated_keys or keys
        if len(known) < end:  # hash only the new chunks, resuming the chain
            known = known + chunk_keys(
                self.ns.fingerprint, tokens[:end * self.chunk_tokens], self.chunk_tokens,
                st.info.extras, start=len(known), parent=known[-1] if known else None)
            st.generated_keys = known
        return known

    def _retentions(self, st: ReqState, n: int | None = None) -> list[ChunkRetention]:
        """The retention of each of the first ``n`` chunks of the request (default: its
        prompt's): its hint, else its priority, else the connector's; a chunk of generated
        tokens only takes the hint's decode retention."""
        n = len(self._keys(st)) if n is None else n
        default = (self._priority(st), None)
        hint = st.info.options.retention
        out = chunk_retentions(hint, n, self.chunk_tokens, len(st.info.tokens), default)
        if hint is not None and hint.decode_priority is None:
            generated = -(-len(st.info.tokens) // self.chunk_tokens)
            out[generated:] = [default] * max(0, n - generated)
        return out

    def _retain_at_finish(self, st: ReqState, reason: str | None,
                          generated: Sequence[int] = ()) -> None:
        """What the request asked for its prefix once it is answered: a release drops it to
        priority 0; a retention (or priority) is set again, its durations counted from now
        (the gap before the next turn), where it is stronger than what the chunk has (another
        request's on a shared prefix stays); then the retention for how it ended
        (``finish``; ``tool_calls``'s for an answer that holds a tool-call token), the same
        way. Runs from the tail, so the chain keeps its order."""
        options = st.info.options
        if not st.keys:
            return
        keys = st.keys
        if st.generated_keys is not None and st.stored_upto > len(keys):
            keys = st.generated_keys[:st.stored_upto]
        if options.release:
            self.link.call(SetPriority(keys, RELEASED[0]), None)
            return
        if options.priority is not None or options.retention is not None:
            for lo, hi, (priority, retain_s) in reversed(runs(self._retentions(st, len(keys)))):
                self.link.call(SetPriority(keys[lo:hi], priority, retain_s,
                                           keep_stronger=True, tenant=options.tenant), None)
        at_end = options.finish.of(reason, generated) if options.finish is not None else None
        if at_end is not None:
            self.link.call(SetPriority(keys, at_end.priority, at_end.duration_s,
                                       keep_stronger=True, tenant=options.tenant), None)


def _runs_outside(start: int, end: int, skip: set[int]) -> list[tuple[int, int]]:
    """The runs of consecutive chunk indices in [start, end) that are not in ``skip``."""
    runs: list[tuple[int, int]] = []
    lo = start
    for c in range(start, end + 1):
        if c == end or c in skip:
            if c > lo:
                runs.append((lo, c))
            lo = c + 1
    return runs
