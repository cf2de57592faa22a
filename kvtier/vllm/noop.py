"""``NoopConnector``: a KV connector that does nothing, the control for measuring one.

vLLM 0.32 (CPU build) runs some workloads faster as soon as *any* KV connector is configured
(measured: prefill of 8 x 2048 tokens ~2x faster with this no-op connector than with none).
To isolate what kvtier itself costs, ``kvtier bench ttft`` compares against this connector
as well as against no connector at all.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NoopConnector(KVConnectorBase_V1):
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
