"""Every overlay renders with ``kubectl kustomize`` and is valid, strictly, against the
Kubernetes API schemas of a pinned version (kubernetes-validate's bundled copies: offline);
what the objects refer to (Secrets, claims, ports, sizes) exists and agrees."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kvtier.config import parse_size

from .kube import (
    KUBE,
    OVERLAYS,
    containers,
    find,
    flag,
    pod_spec,
    quantity,
    readme_claims,
    readme_secrets,
    render,
    unexpanded,
    validate,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {where: render(where) for where in OVERLAYS}


@pytest.mark.parametrize("where", OVERLAYS)
def test_overlay_renders_and_validates(rendered: dict[str, list[dict[str, Any]]],
                                       where: str) -> None:
    objects = rendered[where]
    validate(objects)
    kinds = sorted(f"{o['kind']}/{o['metadata']['name'].split('-')[0]}" for o in objects)
    for kind in ("StatefulSet", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget"):
        assert any(k.startswith(kind + "/") for k in kinds), f"{where}: no {kind}"
    assert find(objects, "Service", "kvtier-vllm")["spec"]["clusterIP"] == "None"
    assert find(objects, "StatefulSet")["spec"]["serviceName"] == "kvtier-vllm"


def test_the_validator_is_strict_and_offline() -> None:
    """A typo in a field fails (strict schemas); the schemas are the package's own files."""
    objects = render("base")
    bad = find(objects, "Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate([bad])
    assert kubernetes_validate.latest_version() >= "1.32"


def test_servicemonitor_component(tmp_path: Path) -> None:
    """The optional component renders on top of an overlay; its selector and port names
    match the Services (a CRD has no schema offline)."""
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    mine = tmp_path / "kubernetes" / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../overlays/s3]\ncomponents: [../components/servicemonitor]\n")
    objects = render(mine)
    validate(objects)
    monitor = find(objects, "ServiceMonitor")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"
                and wanted.items() <= o["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in services} == {"kvtier-vllm", "kvtier-router"}
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


@pytest.mark.parametrize("where", OVERLAYS)
def test_every_reference_resolves(rendered: dict[str, list[dict[str, Any]]],
                                  where: str) -> None:
    """$(VAR) names a variable the container defines; a Secret or claim is made here or is
    one the README tells the user to make, with the keys used; probes name real ports."""
    objects = rendered[where]
    secrets = readme_secrets()
    claims = {o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolumeClaim"}
    claims |= set(readme_claims())
    for c in containers(objects):
        for arg in c.command_line(secrets):
            assert not unexpanded(arg), f"{c.name}: {arg!r} names an undefined variable"
        for var in c.spec.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets.get(ref["name"], []), \
                    f"{c.name}: Secret {ref['name']} key {ref['key']} is not in README.md"
        for source in c.spec.get("envFrom", []):
            assert source["secretRef"]["name"] in secrets
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c.spec:
                c.port(c.spec[probe]["httpGet"]["port"])
        for mount in c.spec.get("volumeMounts", []):
            c.mount(mount["mountPath"])
    for obj in objects:
        pod = pod_spec(obj)
        for volume in (pod or {}).get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secrets.get(name, []), f"{name}: {item['key']}"
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("where", OVERLAYS)
def test_memory_holds_the_arena(rendered: dict[str, list[dict[str, Any]]], where: str) -> None:
    """/dev/shm is memory-backed and holds the arena; the memory request holds /dev/shm and
    the limit is the request (tmpfs pages are the pod's, never reclaimable); a GPU is asked
    for except in the CPU demo."""
    (vllm,) = (c for c in containers(rendered[where]) if c.spec["name"] == "vllm")
    argv = vllm.command_line()
    arena = parse_size(flag(argv, "--arena-size"))
    _, shm = vllm.mount("/dev/shm")
    assert shm["emptyDir"]["medium"] == "Memory"
    shm_bytes = quantity(shm["emptyDir"]["sizeLimit"])
    assert arena < shm_bytes
    resources = vllm.spec["resources"]
    request = quantity(resources["requests"]["memory"])
    assert request >= shm_bytes + (1 << 30), "memory request: engine + arena + /dev/shm"
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    gpu = resources["limits"].get("nvidia.com/gpu")
    if where == "overlays/cpu-demo":
        assert gpu is None
    else:
        assert gpu == flag(argv, "--tensor-parallel-size")


@pytest.mark.parametrize("where", OVERLAYS)
def test_disk_volume_holds_the_disk_tier(rendered: dict[str, list[dict[str, Any]]],
                                         where: str) -> None:
    statefulset = find(rendered[where], "StatefulSet")
    (vllm,) = (c for c in containers(rendered[where]) if c.spec["name"] == "vllm")
    disk = parse_size(flag(vllm.command_line(), "--disk-size"))
    (template,) = statefulset["spec"]["volumeClaimTemplates"]
    storage = quantity(template["spec"]["resources"]["requests"]["storage"])
    assert disk * 1.01 < storage, "the disk tier keeps 1% of its filesystem free"
    _, volume = vllm.mount("/var/cache/kvtier")
    assert volume["name"] == template["metadata"]["name"]


def test_why_the_tenants_file_is_mounted_with_subpath(tmp_path: Path) -> None:
    """A Secret volume's files are links into a timestamped folder (the kubelet's layout:
    KEY -> ..data/KEY, ..data -> ..TIMESTAMP): kvtier opens secret files without following
    links, so the router would refuse the file there. A subPath mount is the file itself."""
    from kvtier.errors import ConfigError
    from kvtier.router.tenants import load_tenants

    from .kube import readme_block

    volume = tmp_path / "volume"
    (volume / "..2026_12_07_00_00_00.1").mkdir(parents=True)
    real = volume / "..2026_12_07_00_00_00.1" / "tenants.yaml"
    real.write_text(readme_block("tenants"))
    real.chmod(0o400)
    (volume / "..data").symlink_to("..2026_12_07_00_00_00.1")
    (volume / "tenants.yaml").symlink_to("..data/tenants.yaml")
    with pytest.raises(ConfigError, match=r"cannot open .*symbolic links"):
        load_tenants(str(volume / "tenants.yaml"), None, None)
    tenants = load_tenants(str(real), None, None)  # what a subPath mount shows
    assert tenants is not None
