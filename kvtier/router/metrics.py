"""The router's own Prometheus metrics (its ``/metrics``), in a registry of its own.

``backend`` is the backend's URL. ``source`` is ``device`` (vLLM's own prefix cache),
``arena``, a lower tier's name, or ``recomputed``. Predicted sources come from the node
servers' lookups and the router's device history at routing time; actual ones from the
response's ``kv_transfer_params.kvtier.tokens`` (whole responses; vLLM 0.32 puts none on
streamed chunks). Both token counters only count requests whose response said, so they
compare like with like.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_WORK = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Buckets for the router's own work per request (a decision, keying, lookups)."""
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0, 120.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests", "Requests answered, by backend, "
                                "endpoint and status", ["backend", "endpoint", "status"],
                                registry=r)
        self.latency = Histogram("kvtier_router_request_seconds", "Time from receiving a "
                                 "request to its last byte, by backend", ["backend", "endpoint"],
                                 buckets=_LATENCY, registry=r)
        self.first_byte = Histogram("kvtier_router_first_byte_seconds", "Time from receiving "
                                    "a request to the backend's first byte", ["backend"],
                                    buckets=_LATENCY, registry=r)
        self.decisions = Counter("kvtier_router_decisions", "Routing decisions, by strategy "
                                 "and reason", ["strategy", "reason"], registry=r)
        self.decision_time = Histogram("kvtier_router_decision_seconds", "Time the strategy "
                                       "took to choose a backend (keying and lookups "
                                       "included)", ["strategy"], buckets=_WORK, registry=r)
        self.keying_time = Histogram("kvtier_router_keying_seconds", "Time to compute a "
                                     "request's prompt keys (chat template, tokenizer, chunk "
                                     "hashes), per request that needed them", buckets=_WORK,
                                     registry=r)
        self.lookup_time = Histogram("kvtier_router_lookup_seconds", "Time one decision "
                                     "waited for its node-server lookups (all in parallel, "
                                     "until their answers settled it)", buckets=_WORK,
                                     registry=r)
        self.lookups_spared = Counter("kvtier_router_lookups_spared", "Node-server lookups "
                                      "a decision did without (not sent, or not waited "
                                      "for): what it knew already settled it", registry=r)
        self.lookups_recalled = Counter("kvtier_router_lookups_recalled", "Node-server "
                                        "lookups answered from the router's memory of "
                                        "earlier answers and of the prompts it sent since "
                                        "(--lookup-memory-s): not waited for", registry=r)
        self.lookups_refreshed = Counter("kvtier_router_lookups_refreshed", "Node-server "
                                         "lookups started in the background to renew a "
                                         "remembered tier's pace over a second old (the "
                                         "decision used the memory, not waiting)", registry=r)
        self.retries = Counter("kvtier_router_retries", "Attempts that failed before any "
                               "byte reached the client and were retried elsewhere",
                               ["backend"], registry=r)
        self.timeouts = Counter("kvtier_router_timeouts", "Requests whose backend sent "
                                "nothing for --request-timeout-s after it had them (504, "
                                "or a stream cut; not retried, the backend stays in)",
                                ["backend"], registry=r)
        self.refused = Counter("kvtier_router_refused", "Requests refused by the router, by "
                               "reason", ["reason"], registry=r)
        self.up = Gauge("kvtier_router_backend_up", "1 if the backend is in rotation",
                        ["backend"], registry=r)
        self.in_flight = Gauge("kvtier_router_in_flight", "Requests the router has at the "
                               "backend", ["backend"], registry=r)
        self.others = Gauge("kvtier_router_backend_others", "Requests the backend runs or "
                            "queues that this router did not send (its /metrics at the last "
                            "health round; the cache strategy counts them in its wait)",
                            ["backend"], registry=r)
        self.step_slope = Gauge("kvtier_router_decode_step_seconds_per_stream", "How much "
                                "each stream decoding on a backend lengthens every decode "
                                "step, as measured from streamed answers on all backends "
                                "(cache strategy; 0 until measured)", registry=r)
        self.speed = Gauge("kvtier_router_prefill_tokens_per_second", "The backend's "
                           "measured prefill speed (cache strategy)", ["backend"], registry=r)
        self.predicted_tokens = Counter("kvtier_router_predicted_tokens", "Prompt tokens by "
                                        "predicted source", ["backend", "source"], registry=r)
        self.actual_tokens = Counter("kvtier_router_actual_tokens", "Prompt tokens by the "
                                     "source the backend reported", ["backend", "source"],
                                     registry=r)
        self.hit_source = Counter("kvtier_router_hit_source", "Requests by predicted and "
                                  "actual main source of their prompt tokens",
                                  ["predicted", "actual"], registry=r)
        self.predicted_ttft = Histogram("kvtier_router_predicted_ttft_seconds", "The cache "
                                        "strategy's TTFT estimate for the backend it chose",
                                        ["backend"], buckets=_LATENCY, registry=r)
        self.loop_lag = Histogram("kvtier_router_loop_lag_seconds", "How much later than "
                                  "asked the router's event loop woke a task that sleeps "
                                  "50 ms at a time: time every request in flight waited "
                                  "(docs/router.md)", buckets=_LATENCY, registry=r)
        self.discovered = Gauge("kvtier_router_backends_discovered", "Backends the "
                                "discovery source (--backends-dns / --backends-file) lists "
                                "now: the router's members", registry=r)
        self.draining = Gauge("kvtier_router_backends_draining", "Backends that left the "
                              "discovered set and still have requests in flight",
                              registry=r)
        self.membership = Counter("kvtier_router_backend_changes", "Backends that joined or "
                                  "left the discovered set", ["change"], registry=r)
        self.discovery_failures = Counter("kvtier_router_discovery_failures", "Discovery "
                                          "rounds that failed (the last good set was kept)",
                                          registry=r)
        self.lookup_failures = Counter("kvtier_router_lookup_failures", "Node-server lookups "
                                       "that failed or timed out", ["server"], registry=r)
        self.sessions_live = Gauge("kvtier_router_sessions_live", "Sessions the router holds "
                                   "(a request within --session-idle-s)", registry=r)
        self.session_retentions = Counter("kvtier_router_sessions_retentions", "Session "
                                          "requests by the retention the router set: "
                                          "finish (one per kind of answer, told apart at "
                                          "its end by --session-tool-tokens), tool_calls "
                                          "(without them: the last answer called a tool), "
                                          "turn, client (its own), capped (the tenant's "
                                          "cap leaves none), none (none configured)",
                                          ["reason"], registry=r)
        self.sessions_ended = Counter("kvtier_router_sessions_ended", "Sessions the router "
                                      "forgot: end (the client said), idle, evicted (the "
                                      "table was full)", ["reason"], registry=r)

    def forget_backend(self, name: str, node: str | None) -> None:
        """Drop a backend's series (it left: churn must not grow /metrics for ever)."""
        for metric in (self.requests, self.latency, self.first_byte, self.retries,
                       self.timeouts, self.up, self.in_flight, self.others, self.speed,
                       self.predicted_tokens, self.actual_tokens, self.predicted_ttft):
            metric.remove_by_labels({"backend": name})
        if node is not None:
            self.lookup_failures.remove_by_labels({"server": node})
