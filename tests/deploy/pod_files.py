"""A container's files, made on this machine: what its mounts would hold, under a temp root.

ConfigMap volumes get the rendered ConfigMap's files, the tenants Secret the README's example,
the model volume a small model's ``config.json``; ``localize`` points a command line's paths
at them. Paths inside the configs stay as written (they are checked, not opened).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import build_parser
from kvtier.launch.plan import ServePlan
from kvtier.launch.serve import build_plan

from .kube import Container, readme_block, readme_secrets

MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "hidden_size": 256, "torch_dtype": "bfloat16"}


def config_maps(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects
            if o["kind"] == "ConfigMap"}


def make_files(c: Container, objects: list[dict[str, Any]], root: Path) -> None:
    """Fill ``root`` with what the container's mounts hold."""
    maps = config_maps(objects)
    for mount in c.spec.get("volumeMounts", []):
        _, volume = c.mount(mount["mountPath"])
        where = root / mount["mountPath"].lstrip("/")
        if "configMap" in volume:
            where.mkdir(parents=True, exist_ok=True)
            for name, text in maps[volume["configMap"]["name"]].items():
                (where / name).write_text(text)
        elif "secret" in volume:
            assert volume["secret"]["secretName"] == "kvtier-tenants", volume
            assert mount.get("subPath") == "tenants.yaml", \
                f"{c.name}: kvtier refuses a Secret volume's symlinked files: use subPath"
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(readme_block("tenants"))
            os.chmod(where, volume["secret"]["defaultMode"] & 0o777)
        elif volume.get("persistentVolumeClaim", {}).get("claimName") == "kvtier-models":
            (where / "model").mkdir(parents=True, exist_ok=True)
            (where / "model" / "config.json").write_text(json.dumps(MODEL_CONFIG))
        else:
            where.mkdir(parents=True, exist_ok=True)


def localize(argv: list[str], c: Container, root: Path) -> list[str]:
    """``argv`` with every path under one of the container's mounts moved under ``root``."""
    mounts = sorted((m["mountPath"] for m in c.spec.get("volumeMounts", [])), key=len,
                    reverse=True)
    out = []
    for arg in argv:
        for path in mounts:
            if arg == path or arg.startswith(path.rstrip("/") + "/"):
                arg = str(root / arg.lstrip("/"))
                break
        out.append(arg)
    return out


def serve_plan(c: Container, objects: list[dict[str, Any]], root: Path,
               monkeypatch: pytest.MonkeyPatch) -> ServePlan:
    """What ``kvtier serve`` would run in the container ``c`` (nothing is started): its
    environment set, its mounts' files under ``root``, its command line parsed by kvtier."""
    for var, value in c.env(readme_secrets()).items():
        monkeypatch.setenv(var, value)
    make_files(c, objects, root)
    argv = localize(c.command_line(readme_secrets()), c, root)
    assert argv[:2] == ["kvtier", "serve"], f"{c.name}: {argv}"
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"{c.name}: {' '.join(argv)}: refused by kvtier's parser") \
            from exc
    return build_plan(args)
