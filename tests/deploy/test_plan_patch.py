"""``kvtier plan --kustomize-patch``: the base with the patch renders, validates, and the
pod's command line gives kvtier serve the sizes the plan chose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from kvtier.config import parse_size

from .kube import KUBE, containers, find, flag, quantity, render, validate
from .pod_files import serve_plan

LLAMA3_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
             "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
GiB = 1 << 30


def plan_and_render(tmp_path: Path, *flags: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA3_8B))
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    mine = tmp_path / "kubernetes" / "mine"
    mine.mkdir()
    rc = main(["plan", "--model", str(model), "--device-memory", "80GiB",
               "--disk-path", str(tmp_path / "disk"), "--json", str(tmp_path / "plan.json"),
               "--kustomize-patch", str(mine / "plan-patch.yaml"), *flags])
    assert rc == 0
    (mine / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../base]\npatches:\n  - path: plan-patch.yaml\n")
    objects = render(mine)
    validate(objects)
    return json.loads((tmp_path / "plan.json").read_text()), objects


def serve_sizes(objects: list[dict[str, Any]], root: Path, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[int, int]:
    """The arena and disk tier kvtier serve would run with, from the patched pod."""
    (vllm,) = [c for c in containers(objects) if c.spec["name"] == "vllm"]
    server = serve_plan(vllm, objects, root, monkeypatch).server
    assert server is not None
    (disk,) = server.tiers
    return server.arena.size_bytes, disk.capacity_bytes


def test_pilot_patch_sizes_memory_and_gpus(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    plan, objects = plan_and_render(tmp_path, "--host-ram", "256GiB", "-tp", "2",
                                    "--gpu-memory-utilization", "0.85", "--max-model-len",
                                    "16384")
    statefulset = find(objects, "StatefulSet")
    (vllm,) = [c for c in containers(objects) if c.spec["name"] == "vllm"]
    env = vllm.env()
    arena = plan["arena_bytes"]
    assert parse_size(env["KVTIER_ARENA_SIZE"]) == arena > 0
    assert env["KVTIER_DISK_SIZE"] == "90GiB"  # a pilot has no disk tier: the base's stays
    resources = vllm.spec["resources"]
    memory = quantity(resources["requests"]["memory"])
    engine = plan["host"]["engines_bytes"]
    assert engine + arena + GiB <= memory < engine + arena + GiB + (1 << 20)
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    assert resources["limits"]["nvidia.com/gpu"] == "2"
    argv = vllm.command_line()
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(argv, "--max-model-len") == "16384"
    _, shm = vllm.mount("/dev/shm")
    assert quantity(shm["emptyDir"]["sizeLimit"]) >= arena + GiB
    assert shm["emptyDir"]["medium"] == "Memory"
    # the patch touched sizes only: the rest of the container is the base's
    assert len(vllm.spec["env"]) == len(find(render("base"), "StatefulSet")["spec"]["template"]
                                            ["spec"]["containers"][0]["env"])
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"][
        "storage"] == "100Gi"
    served_arena, _ = serve_sizes(objects, tmp_path / "pod", monkeypatch)
    assert served_arena == arena


def test_patch_with_a_disk_tier_sizes_its_volume(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    assert main(["trace", "generate", "--sessions", "40", "-o", str(trace)]) == 0
    # a small node: the arena that fits cannot reach the target, so a disk tier is added
    plan, objects = plan_and_render(
        tmp_path, "--trace", str(trace), "--host-ram", "2GiB", "--os-reserve", "0",
        "--page-cache", "0", "--engine-host-memory", "0", "--margin", "0",
        "--disk-size", "200GiB")
    assert plan["disk_bytes"] > 0
    (vllm,) = [c for c in containers(objects) if c.spec["name"] == "vllm"]
    assert parse_size(vllm.env()["KVTIER_DISK_SIZE"]) == plan["disk_bytes"]
    (template,) = find(objects, "StatefulSet")["spec"]["volumeClaimTemplates"]
    storage = quantity(template["spec"]["resources"]["requests"]["storage"])
    assert plan["disk_bytes"] * 1.01 < storage <= plan["disk_bytes"] * 1.02 + 2 * GiB
    assert template["metadata"]["name"] == "disk"
    served = serve_sizes(objects, tmp_path / "pod", monkeypatch)
    assert served == (plan["arena_bytes"], plan["disk_bytes"])


def test_engines_per_node_share_the_arena_and_disk(tmp_path: Path) -> None:
    """With --engines N (N vLLM pods on a node) each pod gets 1/N of the arena and of the
    disk tier, in whole slots, and its own engine's memory."""
    import yaml

    from kvtier.plan.budget import DeviceInputs, HostInputs
    from kvtier.plan.kustomize import kustomize_patch
    from kvtier.plan.model import read_model
    from kvtier.plan.planner import DiskInputs, make_plan

    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    model = read_model(str(tmp_path))
    one = make_plan(model, DeviceInputs(device_bytes=80 * GiB),
                    HostInputs(ram_bytes=512 * GiB, engines=4), DiskInputs("/d", 1 << 40))
    doc = yaml.safe_load(kustomize_patch(one))
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: v["value"] for v in container["env"]}
    arena = int(env["KVTIER_ARENA_SIZE"])
    slot = one.host.slot_bytes
    assert arena % slot == 0 and arena == one.arena_bytes // 4 // slot * slot
    memory = quantity(container["resources"]["requests"]["memory"])
    assert one.host.engines_bytes // 4 + arena + GiB <= memory
    assert memory < one.host.engines_bytes // 4 + arena + GiB + (1 << 20)
