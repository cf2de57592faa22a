"""The endpoint's own counters, before and after the measured rounds (Prometheus text).

vLLM counts prompt tokens served from cache by the tier that supplied them
(``vllm:prompt_tokens_cached_by_source{source=device|host|disk|p2p|external_unspecified}``)
for any connector, kvtier's and LMCache's alike, next to ``vllm:prompt_tokens``. Their
increase over the measured rounds is the run's hit quality per tier even when each streamed
response says nothing (see :mod:`kvtier.bench.openai_client`).

A fleet has one such page per instance, and ``kvtier route`` one of its own that counts its
decisions by reason (``affinity``, ``load``, ...) and times its own work on each (the whole
decision, keying the prompt, waiting for node lookups): :func:`scrape_all` sums several
pages, so a run against a fleet reads where its hits came from on every instance, why the
router sent each request where it did, and what deciding cost it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import httpx

from kvtier.prom import samples

PROMPT = "vllm:prompt_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
KVTIER_LOADED = "vllm:kvtier_loaded_tokens_total"
KVTIER_FAILED = "vllm:kvtier_failed_load_tokens_total"
DECISIONS = "kvtier_router_decisions_total"
PREEMPTIONS = "vllm:num_preemptions_total"
ROUTER_WORK = {"decision": "kvtier_router_decision_seconds",
               "keying": "kvtier_router_keying_seconds",
               "lookup": "kvtier_router_lookup_seconds",
               "first_byte": "kvtier_router_first_byte_seconds",
               "loop_lag": "kvtier_router_loop_lag_seconds"}
"""The router's histograms of its own work per request (their ``_sum`` and ``_count``), of
the time from a request's arrival to its backend's first byte, and of how late its event
loop woke (every request in flight waited that long)."""
_WORK_SERIES = tuple(f"{h}{part}" for h in ROUTER_WORK.values() for part in ("_sum", "_count"))
Counters = dict[str, float]


def parse(text: str) -> Counters:
    """The counters this module reads, summed over other labels: ``name`` or
    ``name|label_value`` (source for the cache counters, tier for kvtier's, reason for the
    router's decisions)."""
    out: Counters = {}
    for s in samples(text, (PROMPT, BY_SOURCE, KVTIER_LOADED, KVTIER_FAILED, DECISIONS,
                                PREEMPTIONS, *_WORK_SERIES)):
        sub = s.labels.get("source") or s.labels.get("tier") or s.labels.get("reason")
        key = f"{s.name}|{sub}" if sub else s.name
        out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(url: str, timeout_s: float = 10.0) -> Counters | None:
    """The counters at ``url``, or None if it does not answer."""
    try:
        resp = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse(resp.text) if resp.status_code == 200 else None


def scrape_all(urls: Sequence[str], timeout_s: float = 10.0) -> Counters | None:
    """The counters of all ``urls`` summed (a fleet's instances and its router), or None if
    any does not answer: a sum with a page missing would be read as a drop."""
    total: Counters = {}
    for url in urls:
        page = scrape(url, timeout_s)
        if page is None:
            return None
        for key, value in page.items():
            total[key] = total.get(key, 0.0) + value
    return total


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, object]:
    """Prompt tokens and cached tokens by source over the interval, the requests vLLM
    preempted (out of device blocks: each recomputes or reloads what it had), kvtier's
    loads, the router's decisions by reason, and the mean of each of its timings
    (:data:`ROUTER_WORK`, in milliseconds, over the interval's observations: a decision,
    keying and lookups per request that needed them, a first byte per answer, a lag per
    wake of the loop)."""
    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    sources = sorted({k.split("|", 1)[1] for k in after if k.startswith(BY_SOURCE + "|")})
    tiers = sorted({k.split("|", 1)[1] for k in after if k.startswith(KVTIER_LOADED + "|")})
    prompt = d(PROMPT)
    cached = {s: int(d(f"{BY_SOURCE}|{s}")) for s in sources}
    out: dict[str, object] = {
        "prompt_tokens": int(prompt),
        "cached_tokens_by_source": cached,
        "hit_ratio": (sum(cached.values()) / prompt) if prompt > 0 else None,
    }
    if PREEMPTIONS in after:
        out["preemptions"] = int(d(PREEMPTIONS))
    if tiers:
        out["kvtier_loaded_tokens"] = {t: int(d(f"{KVTIER_LOADED}|{t}")) for t in tiers}
        out["kvtier_failed_load_tokens"] = int(d(KVTIER_FAILED))
    reasons = sorted({k.split("|", 1)[1] for k in after if k.startswith(DECISIONS + "|")})
    if reasons:
        out["router_decisions"] = {r: int(d(f"{DECISIONS}|{r}")) for r in reasons}
    work = {what: 1000 * d(f"{h}_sum") / n for what, h in ROUTER_WORK.items()
            if (n := d(f"{h}_count")) > 0}
    if work:
        out["router_work_ms"] = {k: round(v, 3) for k, v in work.items()}
    return out
