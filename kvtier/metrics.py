"""Prometheus metrics of one node server (or one embedded store).

Each store gets its own registry, so several embedded servers in one process (tests) never
collide. Label ``tier`` is ``arena`` or a lower tier's name; ``direction`` is ``read`` (from the
tier) or ``write`` (into it).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_IO_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_OP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.lookup_chunks = Counter(
            "kvtier_lookup_chunks", "Chunks asked for by lookups, by outcome",
            ["outcome"], registry=r)
        self.hits = Counter("kvtier_hits", "Chunks leased, by the tier that held them",
                            ["tier"], registry=r)
        self.bytes = Counter("kvtier_bytes", "Bytes moved to or from a tier",
                             ["tier", "direction"], registry=r)
        self.io_seconds = Histogram("kvtier_io_seconds", "Latency of one chunk I/O",
                                    ["tier", "direction"], buckets=_IO_BUCKETS, registry=r)
        self.io_errors = Counter("kvtier_io_errors", "Failed chunk I/O",
                                 ["tier", "direction"], registry=r)
        self.used_bytes = Gauge("kvtier_used_bytes", "Bytes held by a tier", ["tier"],
                                registry=r)
        self.capacity_bytes = Gauge("kvtier_capacity_bytes", "Capacity of a tier", ["tier"],
                                    registry=r)
        self.chunks = Gauge("kvtier_chunks", "Chunks held by a tier", ["tier"], registry=r)
        self.evictions = Counter("kvtier_evictions", "Chunks evicted, by cause",
                                 ["tier", "cause"], registry=r)
        self.admission_refusals = Counter(
            "kvtier_admission_refusals", "Chunks not written to a tier, by reason",
            ["tier", "reason"], registry=r)
        self.checksum_failures = Counter(
            "kvtier_checksum_failures", "Chunks that failed verification (quarantined)",
            ["tier"], registry=r)
        self.untrusted = Counter(
            "kvtier_untrusted", "Input from other writers of a shared tier that was dropped: "
            "chunks failing their MAC, notes too large or unsigned, journal records that do "
            "not parse or name an impossible size", ["tier", "what"], registry=r)
        self.bookings_refused = Counter(
            "kvtier_bookings_refused", "Other writers' journal records of chunks this server "
            "has not verified, refused past a bound of such bookings (per writer or per tier)",
            ["tier", "limit"], registry=r)
        self.store_refusals = Counter(
            "kvtier_store_refusals", "Reservations refused, by reason", ["reason"], registry=r)
        self.leases_active = Gauge("kvtier_leases_active", "Open leases", registry=r)
        self.leases_expired = Counter("kvtier_leases_expired", "Leases and reservations "
                                      "dropped because their client died or timed out",
                                      ["kind"], registry=r)
        self.op_seconds = Histogram("kvtier_request_seconds", "Server time per request",
                                    ["op"], buckets=_OP_BUCKETS, registry=r)
        self.protocol_errors = Counter("kvtier_protocol_errors",
                                       "Malformed or oversized messages", registry=r)
        self.clients = Gauge("kvtier_clients", "Connected clients", registry=r)
        self.io_timeouts = Counter("kvtier_io_timeouts", "Chunk I/O given up after the "
                                   "tier's io_timeout_s", ["tier", "direction"], registry=r)
        self.breaker_state = Gauge("kvtier_breaker_state", "Circuit breaker of a lower tier: "
                                   "0 closed, 1 half-open (probing), 2 open (bypassed)",
                                   ["tier"], registry=r)
        self.breaker_transitions = Counter("kvtier_breaker_transitions", "Breaker changes, "
                                           "by the state entered", ["tier", "to"], registry=r)
        self.read_estimate = Gauge("kvtier_read_estimate_seconds", "Moving average of one "
                                   "chunk's read from a tier (0: unknown)", ["tier"], registry=r)
        self.lock_hold_max = Gauge("kvtier_lock_hold_max_seconds", "Longest hold of the store "
                                   "lock, by operation", ["op"], registry=r)
        self.internal_errors = Counter("kvtier_internal_errors", "Requests that failed inside "
                                       "the server (a bug: logged with its traceback)", ["op"],
                                       registry=r)
        self.retained_chunks = Gauge(
            "kvtier_retained_chunks", "Chunks held by a tier, by retention priority band "
            "(0-34, 35 the default, 36-79, 80-100)", ["tier", "band"], registry=r)
        self.retained_bytes = Gauge(
            "kvtier_retained_bytes", "Bytes held by a tier by retention priority band (the "
            "arena: slots; a lower tier: chunks at its mean chunk size)", ["tier", "band"],
            registry=r)
        self.retention_expiries = Counter(
            "kvtier_retention_expiries", "Chunks whose retention duration ended (back at the "
            "default priority)", ["tier"], registry=r)
        self.expiries_seen: dict[str, int] = {}
        """Each tier's expiries already counted (policies keep a running total)."""
        self.retention_lock = threading.Lock()
        self.quota_clipped = Counter(
            "kvtier_retention_quota_clipped_chunks", "Chunks kept at the default priority "
            "because their tenant's retention quota in the tier was full", ["tier"],
            registry=r)
        self.quota_used = Gauge(
            "kvtier_retention_quota_used_bytes", "Bytes counted against a tenant's retention "
            "quota in a tier (an upper bound: what left since is forgotten when room is "
            "needed)", ["tenant", "tier"], registry=r)
        self.quota_limit = Gauge(
            "kvtier_retention_quota_bytes", "A tenant's retention quota in a tier "
            "(retention_quotas)", ["tenant", "tier"], registry=r)
        self.retention_releases = Counter(
            "kvtier_retention_releases", "Chunks a request released (priority 0)", registry=r)
        self.retained_hits = Counter(
            "kvtier_retained_hits", "Chunks leased, by the tier that held them and whether "
            "they were retained above the default priority then", ["tier", "retained"],
            registry=r)
        self.engine_events = Counter(
            "kvtier_engine_events", "Counters reported by engine clients (e.g. the vLLM "
            "connector's loaded_tokens by tier)", ["client", "event", "tier"], registry=r)
