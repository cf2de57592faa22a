"""Every probe path and port in the manifests is answered by a running server: a real node
server from the ConfigMap's config (as kvtier serve builds it from the pod's command line,
moved to temp paths and loopback), and a real router from the Deployment's command line in
front of a stub backend that it finds by --backends-dns (the name replaced by 127.0.0.1; real
aiohttp servers on loopback; no cluster).

vLLM's own ``/health`` (the vLLM container's startup and readiness probes, on port http) is
vLLM's documented endpoint (200 while its engine lives, 503 once it died); not asked here. The
stack's end-to-end tests with the real vLLM CPU build (tests/vllm/test_e2e_stack.py,
test_e2e_supervise.py) wait on it and restart an instance whose /health stops saying 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from router.stubs import running_router, stubs

from kvtier.cli import build_parser
from kvtier.config import ServerConfig
from kvtier.router.config import RouterConfig
from kvtier.server import EmbeddedServer

from .kube import Container, containers, flag, readme_secrets, render
from .pod_files import localize, make_files, serve_plan

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def probes(c: Container, port: str) -> list[tuple[str, dict[str, Any]]]:
    return [(name, c.spec[name]) for name in PROBES
            if name in c.spec and c.spec[name]["httpGet"]["port"] == port]


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render("base")


def test_probes_are_those_of_the_base_in_every_overlay(base: list[dict[str, Any]]) -> None:
    """What is checked live below on the base holds for every overlay (the CPU demo allows
    a shorter start only)."""
    mine = {c.name: {p: c.spec.get(p) for p in PROBES} for c in containers(base)}
    for where in ("overlays/s3", "overlays/redis", "overlays/nfs", "overlays/cpu-demo"):
        for c in containers(render(where)):
            if c.init:
                continue
            for name in PROBES:
                theirs = dict(c.spec.get(name) or {})
                ours = dict(mine[c.name][name] or {})
                if where == "overlays/cpu-demo" and name == "startupProbe":
                    theirs.pop("failureThreshold", None), ours.pop("failureThreshold", None)
                assert theirs == ours, f"{where} {c.name} {name}"


def test_node_server_answers_the_liveness_probe(base: list[dict[str, Any]], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (vllm,) = [c for c in containers(base) if c.spec["name"] == "vllm"]
    checked = probes(vllm, "kvtier")
    assert checked, "the node server's /healthz is probed"
    plan = serve_plan(vllm, base, tmp_path / "pod", monkeypatch)
    assert plan.server is not None and plan.server.metrics_port == vllm.port("kvtier")
    server = EmbeddedServer(local_config(plan.server, tmp_path)).start()
    try:
        for name, probe in checked:
            url = f"http://127.0.0.1:{server.metrics_port}{probe['httpGet']['path']}"
            status, body, took = asyncio.run(get(url))
            assert status == 200, f"{name} {url}: {status} {body}"
            assert body.get("ok") is True
            assert took < probe.get("timeoutSeconds", 1), f"{name}: {took:.2f} s"
    finally:
        server.stop()


def local_config(server: ServerConfig, tmp_path: Path) -> ServerConfig:
    """The pod's config on this machine: temp socket and disk, a small arena, an ephemeral
    port on loopback."""
    doc = msgspec.to_builtins(server)
    doc.update(socket_path=str(tmp_path / "kvtier.sock"), metrics_port=0,
               metrics_host="127.0.0.1")
    doc.pop("metrics_advertise_host", None)
    doc["arena"].update(size_bytes=8 * doc["arena"]["slot_bytes"], name=None)
    for tier in doc["tiers"]:
        assert tier["type"] == "disk", "the base has the disk tier only"
        tier.update(capacity_bytes=64 << 20)
        tier["options"]["path"] = str(tmp_path / "disk")
    return ServerConfig.from_dict(doc)


def test_router_answers_its_probes(base: list[dict[str, Any]], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ready (/health 200) with a backend up (found through --backends-dns), not ready (503)
    without one, yet alive (/metrics 200): a router with no backend is taken out of the
    Service, not restarted."""
    (router,) = [c for c in containers(base) if c.spec["name"] == "router"]
    for var, value in router.env(readme_secrets()).items():
        monkeypatch.setenv(var, value)
    make_files(router, base, tmp_path)
    asyncio.run(_router_probes(router, tmp_path))


async def _router_probes(router: Container, root: Path) -> None:
    argv = localize(router.command_line(readme_secrets()), router, root)
    assert int(flag(argv, "--port") or 0) == router.port("http")
    async with stubs(1) as (backend,):
        args = build_parser().parse_args(on_loopback(argv, backend.url)[1:])
        config = dataclasses.replace(RouterConfig.from_args(args), health_interval_s=0.1)
        async with running_router(config) as running:
            url = f"http://127.0.0.1:{running.port}"
            ready, live = probe_of(router, "readinessProbe"), probe_of(router, "livenessProbe")
            assert (await get(url + ready["httpGet"]["path"]))[0] == 200
            assert (await get(url + live["httpGet"]["path"]))[0] == 200
            await backend.stop()
            deadline = time.monotonic() + 10
            while (await get(url + ready["httpGet"]["path"]))[0] != 503:
                assert time.monotonic() < deadline, "still ready with no backend up"
                await asyncio.sleep(0.1)
            assert (await get(url + live["httpGet"]["path"]))[0] == 200


def on_loopback(argv: list[str], backend: str) -> list[str]:
    """The router's command line on an ephemeral loopback port, its DNS name for the
    backends (the headless Service's) replaced by the stub's address, and no node servers."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        if arg == "--kvtier-server-port":
            skip = 1
            continue
        replace = {"--host": "127.0.0.1", "--port": "0", "--backends-dns": backend}
        if arg in replace:
            out += [arg, replace[arg]]
            skip = 1
            continue
        out.append(arg)
    assert "--backends-dns" in out, "the router finds its backends through DNS"
    return out


def probe_of(c: Container, name: str) -> dict[str, Any]:
    probe = c.spec[name]
    assert c.port(probe["httpGet"]["port"]) == c.port("http")
    return dict(probe)


async def get(url: str) -> tuple[int, Any, float]:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session, \
            session.get(url) as resp:
        text = await resp.text()
    body: Any = json.loads(text) if resp.content_type == "application/json" else text
    return resp.status, body, time.monotonic() - started
