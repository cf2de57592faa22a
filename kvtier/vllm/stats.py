"""The connector's counters as vLLM stats: logged and exported on vLLM's /metrics.

Workers and the scheduler side each return a :class:`KvtierStats` per step; vLLM sums them
(``aggregate``) and ships ``data`` to its frontend process, which rebuilds the object with
``KvtierConnector.build_kv_connector_stats`` for the "KV Transfer metrics" log line and feeds
:class:`KvtierPromMetrics` for counters named ``vllm:kvtier_<name>_total`` (see
:data:`kvtier.vllm.counters.METRICS`; tier-labelled ones carry a ``tier`` label).
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.vllm.counters import METRICS, merged, split


class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        return KvtierStats(merged(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for name, (doc, by_tier) in METRICS.items():
            self._metrics[name] = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=doc,
                labelnames=labelnames + (["tier"] if by_tier else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for data_key, value in transfer_stats_data.items():
            name, tier = split(data_key)
            metric = self._metrics.get(name)
            if metric is None or not value:
                continue
            _doc, by_tier = METRICS[name]
            if by_tier != (tier is not None):
                continue
            metric.labels(*labels, *([tier] if tier else [])).inc(value)
