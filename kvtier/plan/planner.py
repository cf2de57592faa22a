"""Putting the budgets together into a plan and a server config that ``kvtier server`` runs.

Without a trace the config is a *pilot*: an arena of at most twice the device KV cache (the
chunks most recently pushed out of the device), no disk tier. The seed's discipline is to start
bounded and grow only on measured hit quality, and to add a secondary tier only when retention
pays — which a trace can show (:mod:`kvtier.plan.traffic`): with ``--trace`` the arena is the
smallest that reaches the target share of the achievable hit ratio (never more than fits), and
a disk tier is added only when the arena that fits cannot reach it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.plan.budget import (
    DeviceBudget,
    DeviceInputs,
    GiB,
    HostBudget,
    HostInputs,
    device_budget,
    host_budget,
    payload_bytes,
)
from kvtier.plan.model import ModelShape
from kvtier.plan.traffic import TraceAdvice, advise
from kvtier.trace.formats import Trace

PILOT_DEVICE_MULTIPLE = 2


@dataclass(frozen=True)
class DiskInputs:
    path: str
    free_bytes: int
    share: float = 0.5
    size_bytes: int | None = None
    """Explicit size (instead of ``share`` of the free space)."""

    @property
    def fit_bytes(self) -> int:
        return self.size_bytes if self.size_bytes is not None else int(self.free_bytes *
                                                                       self.share)


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    device_inputs: DeviceInputs
    device: DeviceBudget
    host: HostBudget
    disk: DiskInputs
    chunk_tokens: int
    host_kv_bytes_per_token: int
    arena_bytes: int
    """What the config uses (pilot or recommended), whole slots."""
    disk_bytes: int
    """0: no disk tier in the config."""
    advice: TraceAdvice | None
    config: dict[str, Any]
    host_inputs: HostInputs | None = None


def make_plan(model: ModelShape, d: DeviceInputs, h: HostInputs, disk: DiskInputs,
              chunk_tokens: int = 256, trace: Trace | None = None,
              transfer_gbps: float = 20.0, target_share: float = 0.9,
              max_hit_loss: float = 0.01) -> Plan:
    device = device_budget(model, d)
    payload = payload_bytes(model, d.tp, chunk_tokens, d.kv_dtype)
    host = host_budget(h, d.tp, d.cpu_offload_gb, payload, chunk_tokens)
    if host.arena_slots < 1:
        raise ConfigError(
            f"no host headroom for an arena: {host.ram_bytes / GiB:.1f} GiB of RAM, less OS "
            f"{host.os_bytes / GiB:.1f}, page cache {host.page_cache_bytes / GiB:.1f}, "
            f"co-located {host.colocated_bytes / GiB:.1f}, engines "
            f"{host.engines_bytes / GiB:.1f}, weight offload "
            f"{host.weight_offload_bytes / GiB:.1f} GiB and the margin leave less than one "
            f"{host.slot_bytes}-byte slot")
    per_token = payload // chunk_tokens  # host bytes per token, all ranks
    disk_fit = disk.fit_bytes // host.slot_bytes * host.slot_bytes
    advice = None
    if trace is None:
        device_all_ranks = device.kv_tokens * per_token
        pilot_slots = -(-PILOT_DEVICE_MULTIPLE * device_all_ranks // host.slot_bytes)
        arena_slots = min(host.arena_slots, max(1, pilot_slots))
        disk_bytes = 0
    else:
        advice = advise(trace, per_token, device.kv_tokens, host.arena_tokens,
                        disk_fit // host.slot_bytes * chunk_tokens, transfer_gbps,
                        target_share, max_hit_loss)
        arena_slots = min(host.arena_slots, -(-advice.arena_tokens // chunk_tokens))
        disk_bytes = -(-advice.disk_tokens // chunk_tokens) * host.slot_bytes
    arena_bytes = arena_slots * host.slot_bytes
    config = server_config(arena_bytes, host.slot_bytes, disk_bytes, disk.path,
                           advice.admission if advice else ())
    return Plan(model, d, device, host, disk, chunk_tokens, per_token, arena_bytes, disk_bytes,
                advice, config, h)


def server_config(arena_bytes: int, slot_bytes: int, disk_bytes: int, disk_path: str,
                  admission: tuple[tuple[str, int], ...]) -> dict[str, Any]:
    """A ``kvtier server --config`` document, checked by :class:`ServerConfig` itself."""
    doc: dict[str, Any] = {"arena": {"size_bytes": arena_bytes, "slot_bytes": slot_bytes}}
    if disk_bytes:
        tier: dict[str, Any] = {"type": "disk", "capacity_bytes": disk_bytes,
                                "options": {"path": disk_path}}
        if admission:
            tier["admission"] = dict(admission)
        doc["tiers"] = [tier]
    ServerConfig.from_dict(doc)  # raises ConfigError naming the key if the plan is unusable
    return doc
