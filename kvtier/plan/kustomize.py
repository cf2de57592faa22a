"""A plan as a kustomize patch of ``deploy/kubernetes``'s vLLM StatefulSet.

The base keeps every size in one place per pod: the ``vllm`` container's environment
(``KVTIER_ARENA_SIZE``, ``KVTIER_DISK_SIZE``, ``KVTIER_GPU_MEMORY_UTILIZATION``,
``KVTIER_TENSOR_PARALLEL_SIZE``, ``KVTIER_MAX_MODEL_LEN``, which its command line reads), the
memory request, the GPU limit, the ``/dev/shm`` volume's size and the disk volume's. This
writes them as a strategic-merge patch (env entries merge by name, so nothing else of the
container is touched)::

    memory request = limit = engine + weight offload + arena + SHM_SLACK
    /dev/shm size          = arena + SHM_SLACK   (vLLM's own shared-memory buffers too)
    disk volume            = disk tier * 1.02 + 1 GiB  (the tier keeps 1% of it free)

One pod is one engine: with ``--engines N`` (N vLLM pods per node) each pod gets 1/N of the
arena and of the disk tier the plan sizes for the node.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvtier.plan.budget import GiB
from kvtier.plan.planner import Plan
from kvtier.trace.sizes import show_bytes

MiB = 1 << 20
SHM_SLACK = GiB
STATEFULSET = "kvtier-vllm"
CONTAINER = "vllm"


def kustomize_patch(p: Plan) -> str:
    engines = _engines(p)
    arena = p.arena_bytes // engines // p.host.slot_bytes * p.host.slot_bytes
    disk = p.disk_bytes // engines // p.host.slot_bytes * p.host.slot_bytes
    d = p.device_inputs
    memory = _engine(p) + p.host.weight_offload_bytes // engines + arena + SHM_SLACK
    env = [_var("KVTIER_ARENA_SIZE", arena),
           _var("KVTIER_GPU_MEMORY_UTILIZATION", f"{d.gpu_memory_utilization:g}"),
           _var("KVTIER_TENSOR_PARALLEL_SIZE", d.tp),
           _var("KVTIER_MAX_MODEL_LEN", d.max_model_len)]
    if disk:
        env.append(_var("KVTIER_DISK_SIZE", disk))
    container: dict[str, Any] = {
        "name": CONTAINER, "env": env,
        "resources": {"requests": {"memory": _mi(memory)},
                      "limits": {"memory": _mi(memory), "nvidia.com/gpu": str(d.tp)}}}
    spec: dict[str, Any] = {"template": {"spec": {
        "containers": [container],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory",
                                                 "sizeLimit": _mi(arena + SHM_SLACK)}}]}}}
    if disk:
        spec["volumeClaimTemplates"] = [{
            "metadata": {"name": "disk"},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": _gi(disk * 1.02 + GiB)}}}}]
    doc = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": STATEFULSET},
           "spec": spec}
    return _head(p, arena, disk, memory, engines) + yaml.safe_dump(doc, sort_keys=False)


def _engine(p: Plan) -> int:
    """Host memory of one engine's processes (the plan's --engine-host-memory)."""
    return p.host.engines_bytes // _engines(p)


def _engines(p: Plan) -> int:
    return p.host_inputs.engines if p.host_inputs is not None else 1


def _head(p: Plan, arena: int, disk: int, memory: int, engines: int) -> str:
    lines = [f"kustomize patch from `kvtier plan` for {p.model.path}: the base's "
             f"StatefulSet {STATEFULSET}, one engine per pod"
             + (f" ({engines} per node: 1/{engines} of the node's arena and disk each)"
                if engines > 1 else ""),
             f"arena {show_bytes(arena)}; memory {show_bytes(memory)} = engine "
             f"{show_bytes(_engine(p))} + arena + {show_bytes(SHM_SLACK)} of /dev/shm",
             f"disk tier {show_bytes(disk)}" if disk else
             "no disk tier in the plan (a pilot, or the arena reaches the target): the "
             "base's disk tier and volume are kept as they are"]
    if disk:
        lines.append("a running StatefulSet's volumeClaimTemplates cannot change: recreate it "
                     "(kubectl delete statefulset kvtier-vllm --cascade=orphan, then apply; "
                     "the volumes stay) and resize existing claims yourself")
    return "".join(f"# {line}\n" for line in lines)


def _var(name: str, value: object) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def _mi(n: float) -> str:
    return f"{-(-int(n) // MiB)}Mi"


def _gi(n: float) -> str:
    return f"{-(-int(n) // GiB)}Gi"
