"""Every container's command line, as the kubelet runs it, is parsed by kvtier's own parsers
(and the configs it names by kvtier's config classes), so the manifests cannot drift from the
code: a renamed flag, a bad size or an unknown config key fails here, not in a cluster."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvtier.cli import build_parser
from kvtier.config import TierConfig, parse, parse_size
from kvtier.demo.__main__ import build_parser as demo_parser
from kvtier.errors import ConfigError
from kvtier.launch import serve
from kvtier.router.config import RouterConfig
from kvtier.tiers.files import FileOptions
from kvtier.tiers.redis_options import parse_options as redis_options
from kvtier.tiers.s3_options import parse_s3_options
from kvtier.tiers.shared import split_options

from .kube import (
    OVERLAYS,
    POD_IP,
    SECRET_VALUE,
    Container,
    containers,
    find,
    flag,
    readme_secrets,
    render,
)
from .pod_files import localize, make_files

VLLM_FLAGS = {"--host", "--port", "--tensor-parallel-size", "--gpu-memory-utilization",
              "--max-model-len", "--served-model-name", "--kv-transfer-config", "--model",
              "--enable-prompt-tokens-details", "--enforce-eager", "--kv-cache-memory-bytes"}
"""vLLM's own options the manifests use (kvtier serve hands unknown options to vLLM, so a
kvtier flag misspelt would reach vLLM: only these may)."""


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {where: render(where) for where in OVERLAYS}


def cases() -> list[tuple[str, str]]:
    return [(where, name) for where in OVERLAYS for name in ("vllm", "router", "demo-model")
            if name != "demo-model" or where == "overlays/cpu-demo"]


@pytest.mark.parametrize(("where", "name"), cases())
def test_command_line_parses(rendered: dict[str, list[dict[str, Any]]], where: str, name: str,
                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = rendered[where]
    found = [c for c in containers(objects) if c.spec["name"] == name]
    assert found, f"{where}: no container {name}"
    for c in found:
        check_container(c, objects, tmp_path / c.owner["kind"], monkeypatch)


def check_container(c: Container, objects: list[dict[str, Any]], root: Path,
                    monkeypatch: pytest.MonkeyPatch) -> None:
    env = c.env(readme_secrets())
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    argv = c.command_line(readme_secrets())
    make_files(c, objects, root)
    local = localize(argv, c, root)
    if argv[0] == "kvtier":
        args = parse_kvtier(c, local[1:])
        check = {"serve": check_serve, "route": check_route}[args.command]
        check(c, args, objects, root, monkeypatch)
    else:
        assert argv[:3] == ["python", "-m", "kvtier.demo"], f"{c.name}: {argv}"
        demo_parser().parse_args(local[3:])
        check_demo(c, demo_parser().parse_args(argv[3:]), objects)


def test_drift_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What these checks exist for: a misspelt kvtier flag (kvtier serve would hand it to
    vLLM), a key kvtier's config does not know, a flag the router does not have."""
    def vllm_of(objects: list[dict[str, Any]]) -> Container:
        return next(c for c in containers(objects) if c.spec["name"] == "vllm")

    objects = render("base")
    vllm = vllm_of(objects)
    vllm.spec["args"][vllm.spec["args"].index("--log-file")] = "--logfile"
    with pytest.raises(AssertionError, match=r"handed to vLLM: \['--logfile'\]"):
        check_container(vllm, objects, tmp_path / "flag", monkeypatch)
    objects = render("base")
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config["data"]["server.yaml"] += "arena_size: 1GiB\n"
    with pytest.raises(ConfigError, match="arena_size: unknown key"):
        check_container(vllm_of(objects), objects, tmp_path / "key", monkeypatch)
    objects = render("base")
    (router,) = [c for c in containers(objects) if c.spec["name"] == "router"]
    router.spec["args"].append("--backend-dns")
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_container(router, objects, tmp_path / "route", monkeypatch)


def test_every_container_is_checked(rendered: dict[str, list[dict[str, Any]]]) -> None:
    names = {c.spec["name"] for objects in rendered.values() for c in containers(objects)}
    assert names == {"vllm", "router", "demo-model"}


def parse_kvtier(c: Container, argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{c.name}: kvtier {' '.join(argv)}: refused by its parser "
                             "(see the error above)") from exc


def check_serve(c: Container, args: argparse.Namespace, objects: list[dict[str, Any]],
                root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``kvtier serve`` would run: the embedded server's config and vLLM's argv."""
    if args.model is None:  # the demo model, built by the initContainer
        (root / "demo-model").mkdir()
        (root / "demo-model" / "config.json").write_text(
            (root / "models" / "model" / "config.json").read_text()
            if (root / "models" / "model").exists() else
            '{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,'
            ' "hidden_size": 256, "torch_dtype": "bfloat16"}')
        monkeypatch.setattr(serve, "_demo_model", lambda: str(root / "demo-model"))
    plan = serve.build_plan(args)
    server = plan.server
    assert server is not None, f"{c.name}: the node server must run in kvtier serve"
    env = c.env(readme_secrets())
    assert server.arena.size_bytes == parse_size(env["KVTIER_ARENA_SIZE"])
    (disk,) = [t for t in server.tiers if t.type == "disk"]
    assert disk.capacity_bytes == parse_size(env["KVTIER_DISK_SIZE"])
    assert disk.options["path"].startswith("/var/cache/kvtier/")
    c.mount("/var/cache/kvtier")
    for tier in server.tiers:
        check_tier_options(tier, c)
    assert server.metrics_port == c.port("kvtier")
    assert server.metrics_host == "0.0.0.0"
    assert getattr(server, "metrics_advertise_host", None) == POD_IP
    check_vllm_argv(c, plan.cmd)
    service = find(objects, "Service", "kvtier-vllm")
    targets = {p["name"]: c.port(p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets == {"http": int(flag(plan.cmd, "--port") or 0), "kvtier": 9477}


def check_tier_options(tier: TierConfig, c: Container) -> None:
    """Each tier's options as the tier itself parses them (no connection made)."""
    where = f"tiers[{tier.name}].options"
    if tier.type in ("disk", "fs"):
        own, _ = split_options(tier.options, where) if tier.type == "fs" else (
            dict(tier.options), None)
        parse(FileOptions, own, where)
    elif tier.type == "s3":
        options, _ = parse_s3_options(tier.options, where)
        assert str(options.credential_source) == "env"
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(c.env(readme_secrets()))
    elif tier.type == "redis":
        own, _ = split_options(tier.options, where)
        options = redis_options(own, where)
        assert options.password_env in c.env(readme_secrets())
    else:
        raise AssertionError(f"{c.name}: tier type {tier.type}: add its options' check")
    if tier.type == "fs":
        path = str(tier.options["path"])
        assert any(path.startswith(m["mountPath"] + "/")
                   for m in c.spec["volumeMounts"]), f"{path} is on no volume"
    if tier.type in ("s3", "redis", "fs"):
        assert "KVTIER_SHARED_SECRET" in c.env(readme_secrets()), "shared tiers need it"


def check_vllm_argv(c: Container, cmd: list[str]) -> None:
    start = cmd.index("vllm.entrypoints.openai.api_server") + 1
    flags = {a.split("=")[0] for a in cmd[start:] if a.startswith("-") and a != "-"}
    assert flags <= VLLM_FLAGS, f"{c.name}: handed to vLLM: {sorted(flags - VLLM_FLAGS)}"
    assert flag(cmd, "--host") == "0.0.0.0"
    assert int(flag(cmd, "--port") or 0) == c.port("http")


def check_route(c: Container, args: argparse.Namespace, objects: list[dict[str, Any]],
                root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = RouterConfig.from_args(args)
    assert config.host == "0.0.0.0"
    assert config.port == c.port("http")
    assert config.node_token == SECRET_VALUE
    assert config.tenants is not None
    service = find(objects, "Service", "kvtier-vllm")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    url = urlsplit(args.backends_dns)
    assert (url.hostname, url.port) == (service["metadata"]["name"], ports["http"])
    assert args.kvtier_server_port == ports["kvtier"]
    (vllm,) = [v for v in containers(objects) if v.spec["name"] == "vllm" and not v.init]
    check_tokenizer(c, vllm, objects)
    stop = vllm.spec["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[0] == "sleep" and float(stop[1]) > args.discovery_interval_s + \
        args.health_interval_s, "a stopping vLLM pod leaves the router's view before it stops"


def check_tokenizer(router: Container, vllm: Container, objects: list[dict[str, Any]]) -> None:
    """The cache strategy loads the tokenizer the engines registered (their --model path):
    the router has it at the same path, from the same claim or built by the same recipe."""
    env = vllm.env(readme_secrets())
    argv = vllm.command_line(readme_secrets())
    model = flag(argv, "--model") or f"{env['KVTIER_CACHE_DIR']}/demo-model"
    (path,) = [m["mountPath"] for m in router.spec["volumeMounts"]
               if model.startswith(m["mountPath"] + "/")]
    _, mine = router.mount(path)
    _, theirs = vllm.mount(path)
    if "persistentVolumeClaim" in theirs:
        assert mine.get("persistentVolumeClaim") == theirs["persistentVolumeClaim"]
    else:
        builders = [c for c in containers([router.owner]) if c.init]
        assert [flag(c.command_line(), "--path") for c in builders] == [model]


def check_demo(c: Container, args: argparse.Namespace, objects: list[dict[str, Any]]) -> None:
    """The initContainer builds the model where the serving container looks for it."""
    (main,) = [m for m in containers([c.owner]) if not m.init]
    (vllm,) = [m for m in containers(objects) if m.spec["name"] == "vllm"]
    cache = vllm.env(readme_secrets()).get("KVTIER_CACHE_DIR")
    assert cache and args.path == f"{cache}/demo-model", "not where kvtier serve looks"
    mine = {m["mountPath"]: m["name"] for m in c.spec["volumeMounts"]}
    theirs = {m["mountPath"]: m["name"] for m in main.spec["volumeMounts"]}
    (path,) = [p for p in mine if cache.startswith(p + "/")]
    assert theirs.get(path) == mine[path], "the model's volume is not the serving container's"
