"""The connector's configuration, parsed once from vLLM's ``kv_connector_extra_config``.

Two ways to reach a node server, exactly one of which must be given:

- ``server_socket``: connect to a server that already runs (``kvtier server``, ``kvtier
  serve``, or one shared by several engines on the node).
- ``server``: a :class:`~kvtier.config.ServerConfig` mapping; the connector in the scheduler
  role (vLLM's EngineCore process) starts it embedded and workers connect to its
  ``socket_path``. ``arena.slot_bytes`` may be left out: it is sized to fit one chunk.

Example (JSON, as passed to ``--kv-transfer-config``)::

    {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {
        "server": {"socket_path": "/tmp/kvtier.sock", "arena": {"size_bytes": "4GiB"},
                   "tiers": [{"type": "disk", "capacity_bytes": "64GiB",
                              "options": {"path": "/var/cache/kvtier"}}]},
        "chunk_tokens": 256, "priority": 35}}
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from kvtier.bounds import NonNegative, Positive, check_bounds
from kvtier.codec import HEADER_SIZE, align_up
from kvtier.config import ConfigStruct, ServerConfig, parse
from kvtier.errors import ConfigError
from kvtier.hints import FinishRetention, Priority, RetentionHint

_PLACEHOLDER_SLOT = HEADER_SIZE + 4096
log = logging.getLogger("kvtier.vllm")


class FaultConfig(ConfigStruct, frozen=True):
    """Test hooks; never set these in production."""

    hold_loads_s: NonNegative = 0.0
    """Keep each load job on the scheduler for this long before the worker may run it."""

    def __post_init__(self) -> None:
        check_bounds(self)


class ConnectorConfig(ConfigStruct, frozen=True):
    server_socket: str = ""
    server: Mapping[str, Any] | None = None
    chunk_tokens: Annotated[int, Meta(ge=1)] = 256
    priority: Priority = 35
    """Default retention priority (0-100) of stored chunks; a request may override it."""
    load_timeout_s: Positive = 10.0
    """A chunk not promoted into the arena within this time is recomputed instead."""
    client_timeout_s: Positive = 2.0
    """Per-call timeout towards the server; a slower answer counts as the server being down."""
    retry_interval_s: Positive = 1.0
    """After the server was unreachable, calls are skipped (misses) for this long."""
    load: bool = True
    store: bool = True
    store_generated: bool = False
    """Store full chunks of generated tokens too (a request with a decode retention always
    has them stored): the next turn of a conversation starts with them."""
    share_loads: bool = True
    """A request whose prefix another request of this engine is loading waits for that load
    (at most ``load_timeout_s``) and shares its blocks (needs vLLM's prefix caching)."""
    load_or_recompute: bool = True
    """Skip the tail of a hit that would arrive later than recomputing it."""
    prefill_tokens_per_s: NonNegative = 0.0
    """This engine's prefill speed for that decision; 0 measures it from its own steps."""
    model_id: str | None = None
    """Overrides the model identity in chunk keys (e.g. the same checkpoint at two paths)."""
    kv_events_interval_s: NonNegative = 0.5
    """With vLLM's ``kv_events_config`` on: how often the scheduler side reads the server's
    store events into vLLM's KV-event stream (also at once after it stored or leased)."""
    kv_events_chunks: Annotated[int, Meta(ge=1)] = 16384
    """Chunks whose vLLM block hashes the scheduler side remembers for those events."""
    faults: FaultConfig = msgspec.field(default_factory=FaultConfig)

    def __post_init__(self) -> None:
        check_bounds(self)
        if bool(self.server_socket) == (self.server is not None):
            raise ConfigError("server: give exactly one of server_socket (connect to a running "
                              "kvtier server) or server (start one embedded)")
        if self.server is not None:
            self.server_config(payload_len=_PLACEHOLDER_SLOT - HEADER_SIZE)  # validate early

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        return parse(cls, dict(extra or {}), "kv_connector_extra_config")

    @property
    def socket_path(self) -> str:
        """Where both the scheduler and the workers find the server."""
        if self.server_socket:
            return self.server_socket
        return self.server_config(payload_len=_PLACEHOLDER_SLOT - HEADER_SIZE).socket_path

    def server_config(self, payload_len: int) -> ServerConfig:
        """The embedded server's config, with slots sized for ``payload_len`` if unset."""
        if self.server is None:
            raise ConfigError("no embedded server configured (server_socket is used)")
        data: dict[str, Any] = copy.deepcopy(dict(self.server))
        arena = data.get("arena") or {}
        if isinstance(arena, Mapping):  # anything else: ServerConfig names the key
            data["arena"] = {"slot_bytes": HEADER_SIZE + align_up(payload_len), **arena}
        try:
            return ServerConfig.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"server.{exc}") from exc


class RequestOptions(ConfigStruct, frozen=True):
    """Per-request knobs from ``kv_transfer_params = {"kvtier": {...}}``."""

    priority: Priority | None = None
    load: bool = True
    store: bool = True
    retention: RetentionHint | None = None
    """Priority and duration for the prompt or token ranges of it (:mod:`kvtier.hints`)."""
    release: bool = False
    """The prefix is done: its chunks drop to priority 0 when the request finishes."""
    finish: FinishRetention | None = None
    """A retention per way the request may end, set on its chunks when it does (the
    router's session retention: :mod:`kvtier.router.sessions`)."""
    tenant: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    """Whose retention quota its chunks count against in the store (the router sets it)."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.release and self.retention is not None:
            raise ConfigError("release and retention exclude each other: a released prefix "
                              "is kept at priority 0")
        if (self.priority is not None and self.retention is not None
                and self.retention.priority is not None):
            raise ConfigError("priority and retention.priority both set: give one")

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> RequestOptions:
        """Parse a request's options; bad user input falls back to the defaults.

        A client's typo must not fail its request (the cache is an accelerator), so the
        error is logged, not raised into vLLM.
        """
        raw = params.get("kvtier") if isinstance(params, Mapping) else None
        if not isinstance(raw, Mapping):
            return cls()
        try:
            return parse(cls, dict(raw), "kv_transfer_params.kvtier")
        except ConfigError as exc:
            log.warning("ignoring bad kvtier request options: %s", exc)
            return cls()
