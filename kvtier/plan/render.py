"""The plan as text: budgets line by line, the trace's four answers, the server config."""

from __future__ import annotations

import yaml

from kvtier.plan.budget import CPU_OFFLOAD_NOTE
from kvtier.plan.planner import Plan
from kvtier.plan.traffic import TraceAdvice
from kvtier.tables import table
from kvtier.trace.report import pct
from kvtier.trace.sizes import show_bytes, show_tokens


def plan_text(p: Plan) -> str:
    m, d, dev = p.model, p.device_inputs, p.device
    params = f"{m.params / 1e9:.2f}B params" if m.params >= 1e8 else f"{m.params:,} params"
    lines = [
        f"kvtier plan: {m.path}",
        f"  model     {m.layers} layers, {m.kv_heads} KV heads x {m.head_dim}, {m.dtype}, "
        f"{params} ({'counted' if m.params_exact else 'estimated from config.json'})",
        f"  KV        {show_bytes(m.kv_bytes_per_token(d.kv_dtype))} per token (all heads); "
        f"{show_bytes(dev.kv_bytes_per_token)} per token per GPU at TP={d.tp}",
        "",
        f"device, per GPU (TP={d.tp}, max_model_len {d.max_model_len:,})",
        table(None, [*_device_rows(p), ["", "", ""], ["host", "", ""], *_host_rows(p)],
              align="lrl"),
    ]
    if d.cpu_offload_gb:
        lines += ["", "note: " + CPU_OFFLOAD_NOTE]
    if p.advice is not None:
        lines += ["", advice_text(p.advice, p)]
    else:
        lines += ["", f"pilot: an arena of {show_bytes(p.arena_bytes)} (at most twice the "
                  "device KV cache) and no disk tier; measure hit quality (kvtier bench "
                  "multiround) before growing it, or give --trace to size it from traffic"]
    return "\n".join(lines)


def _device_rows(p: Plan) -> list[list[str]]:
    """The device ledger: label, figure, how it was found."""
    d, dev = p.device_inputs, p.device
    rows = [
        ["  usable", show_bytes(dev.usable_bytes),
         f"= {show_bytes(d.device_bytes)} x {d.gpu_memory_utilization:g}"],
        ["  - weights", show_bytes(dev.weights_bytes), ""],
        ["  - workspace", show_bytes(dev.workspace_bytes),
         f"(activations of {d.max_num_batched_tokens:,} batched tokens, logits, "
         f"{'no CUDA graphs' if d.enforce_eager else 'CUDA graphs'}, non-torch; "
         "check vLLM's 'Available KV cache memory' log line)"],
        ["  = KV cache", show_bytes(dev.kv_bytes), f"= {show_tokens(dev.kv_tokens)} "
         f"({dev.full_sequences:.1f} sequences of max_model_len)"],
    ]
    if dev.kv_tokens < d.max_model_len:
        rows.append(["  !", "", "less than one sequence of max_model_len: vLLM will refuse "
                     f"to start; lower --max-model-len to {dev.kv_tokens:,} or less"])
    return rows


def _host_rows(p: Plan) -> list[list[str]]:
    """The host ledger, and the disk that fits."""
    host = p.host
    spent = [("OS", host.os_bytes, ""), ("page cache", host.page_cache_bytes, ""),
             ("co-located", host.colocated_bytes, ""), ("engines", host.engines_bytes, ""),
             ("weight offload", host.weight_offload_bytes, "(--cpu-offload-gb)"),
             ("margin", host.margin_bytes, "")]
    arena = (f"-> an arena of up to {host.arena_slots:,} slots of {show_bytes(host.slot_bytes)}"
             f" = {show_tokens(host.arena_tokens)} "
             f"({_times(host.arena_tokens, p.device.kv_tokens)} the device KV cache)")
    disk_tokens = p.disk.fit_bytes // host.slot_bytes * p.chunk_tokens
    return [
        ["  RAM", show_bytes(host.ram_bytes), ""],
        *(["  - " + name, show_bytes(size), note] for name, size, note in spent),
        ["  = headroom", show_bytes(host.headroom_bytes), arena],
        ["disk", show_bytes(p.disk.fit_bytes), f"fits in {p.disk.path} "
         f"({show_tokens(disk_tokens)})"],
    ]


def _times(a: int, b: int) -> str:
    return f"{a / b:.1f}x" if b else "-"


def advice_text(a: TraceAdvice, p: Plan) -> str:
    an = a.analysis
    s, r = an.sharing, an.reuse
    hottest = s.hottest[0] if s.hottest else None
    lines = [f"trace {an.source} ({an.arrivals.requests:,} requests, {an.block_tokens}-token "
             "blocks)",
             f"  1 shared: {pct(s.shared_blocks / max(1, s.unique_blocks))} of blocks are in "
             "two or more requests"
             + (f"; the hottest prefix: {hottest.prefix_tokens:,} tokens in "
                f"{hottest.requests:,} requests" if hottest else "")
             + f"; an infinite cache would serve {pct(an.hits.token_hit_ratio)} of prompt "
             "tokens"]
    reuse = r.reuse_time_s
    line = (f"  2 reused: after {_s(reuse.p50)} (median), {_s(reuse.p90)} (p90); stack "
            f"distance p50 {show_tokens(r.stack_distance_tokens.p50)}, p90 "
            f"{show_tokens(r.stack_distance_tokens.p90)}")
    if a.reach is not None:
        line += (f"; {pct(a.reach.within_device)} of reuses fall within the device KV cache, "
                 f"{pct(a.reach.within_arena)} within device + the recommended arena")
    lines.append(line)
    kv = an.kv
    if kv is not None:
        line = (f"  3 size: {show_bytes(kv.hit_bytes_per_request.p50)} of KV to load per "
                f"request (median), {show_bytes(kv.hit_bytes_per_request.p99)} (p99)")
        if kv.load_ms_per_request is not None and kv.transfer_gbps:
            line += (f": {kv.load_ms_per_request.p50 or 0:.1f} / "
                     f"{kv.load_ms_per_request.p99 or 0:.1f} ms at {kv.transfer_gbps:g} GB/s; "
                     f"the busiest second needs {pct(kv.peak_budget_share)} of that budget")
        lines.append(line)
    lines.append(f"  4 never back: {pct(r.never_reused_share)} of blocks are used by one "
                 "request only (write cost, no hit)")
    rec = a.recommendation
    lines.append(f"recommend: arena {show_bytes(p.arena_bytes)} "
                 f"({show_tokens(a.arena_tokens)}) reaches "
                 f"{'the target' if rec.host else 'as much as fits of the target'}: "
                 f"{pct(rec.target_share)} of the achievable "
                 f"{pct(rec.achievable_block_hit_ratio)} block hit ratio")
    if p.disk_bytes:
        rules = ", ".join(f"{k}={v}" for k, v in a.admission) or "always"
        lines.append(f"  + disk tier {show_bytes(p.disk_bytes)} "
                     f"({show_tokens(a.disk_tokens)}), admission {rules}")
    else:
        lines.append("  no disk tier: the arena alone reaches the target (add one only when "
                     "retention pays)")
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f} s"


def config_yaml(p: Plan) -> str:
    head = (f"# kvtier server config from `kvtier plan` for {p.model.path}\n"
            f"# arena: {p.host.arena_slots and p.arena_bytes // p.host.slot_bytes} slots of "
            f"{p.chunk_tokens} tokens ({show_bytes(p.arena_bytes)})")
    if p.disk_bytes:
        head += f"; disk: {show_bytes(p.disk_bytes)}"
    return head + "\n" + yaml.safe_dump(p.config, sort_keys=False)
