"""Rendering the kustomize manifests and reading what their containers run, with no cluster.

``render`` runs ``kubectl kustomize`` (kubectl ships in the base image; nothing is sent
anywhere). ``command_line`` is a container's command and args with ``$(VAR)`` expanded as the
kubelet expands them, from the container's own environment: literal values as given, values
from the downward API or a Secret by the stand-ins below (a Secret's real value is the user's).
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBE = REPO / "deploy" / "kubernetes"
OVERLAYS = ("base", "overlays/s3", "overlays/redis", "overlays/nfs", "overlays/cpu-demo")
K8S_VERSION = "1.32.0"
"""The Kubernetes API the manifests are validated against (kubernetes-validate's schemas)."""

POD_IP = "10.1.2.3"
SECRET_VALUE = "k8s-test-secret-value-0123456789"
"""Stands in for every Secret value (long enough for a node token)."""
FIELD_VALUES = {"status.podIP": POD_IP, "metadata.name": "kvtier-vllm-0",
                "metadata.namespace": "default"}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is needed to render deploy/kubernetes (kubectl kustomize, "
                    "kustomize v5): it ships in the base image; elsewhere install it from "
                    "https://kubernetes.io/docs/tasks/tools/ (make system-deps says so)")
    return path


def render(where: str | Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` makes of a kustomization folder (the folders of
    deploy/kubernetes, named as a string, are rendered once per test session)."""
    if isinstance(where, str):
        return copy.deepcopy(_render_once(where))
    return _render(where)


@functools.cache
def _render_once(where: str) -> list[dict[str, Any]]:
    return _render(KUBE / where)


def _render(path: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return dict(obj["spec"]["template"]["spec"])
    return None


@dataclass(frozen=True)
class Container:
    owner: dict[str, Any]
    spec: dict[str, Any]
    init: bool

    @property
    def name(self) -> str:
        return f"{self.owner['kind']}/{self.owner['metadata']['name']}:{self.spec['name']}"

    @property
    def pod(self) -> dict[str, Any]:
        pod = pod_spec(self.owner)
        assert pod is not None
        return pod

    def env(self, secrets: Mapping[str, str] | None = None) -> dict[str, str]:
        """The container's variables as the kubelet sets them (envFrom first, env after)."""
        out: dict[str, str] = {}
        for source in self.spec.get("envFrom", []):
            for key in (secrets or {}).get(source.get("secretRef", {}).get("name", ""), []):
                out[key] = SECRET_VALUE
        for var in self.spec.get("env", []):
            if "value" in var:
                out[var["name"]] = expand(var["value"], out)
            elif "fieldRef" in var.get("valueFrom", {}):
                out[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in var.get("valueFrom", {}):
                out[var["name"]] = SECRET_VALUE
            else:
                raise AssertionError(f"{self.name}: env {var['name']}: unknown source {var}")
        return out

    def command_line(self, secrets: Mapping[str, str] | None = None) -> list[str]:
        env = self.env(secrets)
        return [expand(a, env) for a in [*self.spec.get("command", []),
                                          *self.spec.get("args", [])]]

    def mount(self, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The volumeMount at ``path`` and its volume."""
        mounts = [m for m in self.spec.get("volumeMounts", []) if m["mountPath"] == path]
        assert len(mounts) == 1, f"{self.name}: no single mount at {path}"
        claims = [{"name": t["metadata"]["name"], "persistentVolumeClaimTemplate": t}
                  for t in self.owner["spec"].get("volumeClaimTemplates", [])]
        volumes = [v for v in [*self.pod.get("volumes", []), *claims]
                   if v["name"] == mounts[0]["name"]]
        assert len(volumes) == 1, f"{self.name}: volume {mounts[0]['name']} is not defined"
        return mounts[0], volumes[0]

    def port(self, ref: str | int) -> int:
        if isinstance(ref, int):
            return ref
        ports = [p["containerPort"] for p in self.spec.get("ports", []) if p["name"] == ref]
        assert len(ports) == 1, f"{self.name}: no container port named {ref}"
        return int(ports[0])


def containers(objects: list[dict[str, Any]]) -> Iterator[Container]:
    for obj in objects:
        pod = pod_spec(obj)
        if pod is None:
            continue
        for spec in pod.get("initContainers", []):
            yield Container(obj, spec, True)
        for spec in pod["containers"]:
            yield Container(obj, spec, False)


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$$`` is a literal ``$``, a reference to a variable
    that is not defined stays as written."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REF.sub(one, text)


def unexpanded(text: str) -> list[str]:
    return [m.group(1) for m in _REF.finditer(text) if m.group(1)]


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` in ``argv`` (``--x v``), or None."""
    for i, arg in enumerate(argv[:-1]):
        if arg == name:
            return argv[i + 1]
    return None


def readme_secrets() -> dict[str, list[str]]:
    """The Secrets the README tells the user to create: name -> keys, from its
    ``kubectl create secret generic NAME --from-literal=KEY=... --from-file=KEY=...`` lines."""
    text = (KUBE / "README.md").read_text()
    text = text.replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.search(r"kubectl create secret generic ([a-z0-9-]+)(.*)", line)
        if match:
            out[match.group(1)] = re.findall(r"--from-(?:literal|file)=([A-Za-z0-9_.-]+)=",
                                             match.group(2))
    return out


def readme_claims() -> list[str]:
    """The PersistentVolumeClaims the README tells the user to provide (``claimName: X``)."""
    return re.findall(r"PersistentVolumeClaim `([a-z0-9-]+)`", (KUBE / "README.md").read_text())


def readme_block(tag: str) -> str:
    """The README's fenced block that follows a line holding ``<!-- tag -->``."""
    text = (KUBE / "README.md").read_text()
    match = re.search(rf"<!-- {tag} -->\s*```[a-z]*\n(.*?)```", text, re.S)
    assert match, f"README.md: no block marked <!-- {tag} -->"
    return match.group(1)


CRD_KINDS = {"ServiceMonitor"}
"""Custom resources: no schema offline; checked by hand below."""


def validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: "
                                 f"{exc.message} at {list(exc.path)}") from exc


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "": 1}


def quantity(text: str) -> int:
    """Bytes of a Kubernetes quantity such as ``17Gi``."""
    number = text.rstrip("KMGTkimB")
    return int(float(number) * _UNITS[text[len(number):]])
