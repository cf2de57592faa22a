"""Credentials in backend URLs never show (names, /metrics, X-Kvtier-Backend, logs, error
messages) while the requests still carry them; the node token goes with every node-server
call."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from store_helpers import NS
from stubs import MODEL, completion, post, router_config, running_router, stubs

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig
from kvtier.router.redact import Scrubber, redact_url

USER, PASSWORD = "svc", "p%40ss-w0rd-sekrit"  # percent-encoded '@' inside
NODE_TOKEN = "node-token-0123456789abcdef"


def with_credentials(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@")


def test_credentials_in_backend_urls_never_show(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    plain = PASSWORD.replace("%40", "@")

    async def main() -> None:
        async with stubs(1) as backends, aiohttp.ClientSession() as s:
            live = with_credentials(backends[0].url)
            dead = with_credentials("http://127.0.0.1:9")  # nothing listens: errors, logs
            config = RouterConfig(backends=(live, dead), kvtier_servers=(None, None), port=0,
                                  health_interval_s=0.2)
            assert plain not in repr(config) and PASSWORD not in repr(config)
            async with running_router(config) as router:
                router.pool.set_health(router.pool.backends[1], True, "pretend it is up")
                url = f"http://127.0.0.1:{router.port}"
                names = set()
                for _ in range(4):  # the dead one fails before answering: retried
                    status, _doc, headers = await post(s, f"{url}/v1/completions",
                                                       completion())
                    assert status == 200
                    names.add(headers["X-Kvtier-Backend"])
                assert names == {redact_url(live)} and "***@127.0.0.1" in names.pop()
                sent = backends[0].seen[-1]["headers"]["Authorization"]
                assert base64.b64decode(sent.split()[1]).decode() == f"{USER}:{plain}", \
                    "the request still carries the credentials"
                async with s.get(f"{url}/metrics") as resp:
                    metrics = await resp.text()
                assert "***@127.0.0.1:9" in metrics
                text = metrics + repr([b.name for b in router.pool])
                assert PASSWORD not in text and plain not in text
            assert any("127.0.0.1:9" in r.getMessage() for r in caplog.records)
    asyncio.run(main())
    logged = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert PASSWORD not in logged and plain not in logged


def test_scrubber_and_config_checks() -> None:
    scrub = Scrubber([with_credentials("http://h:1"), None, "http://plain:2"])
    assert scrub(f"failed at http://{USER}:{PASSWORD}@h:1/x") == "failed at http://***@h:1/x"
    assert scrub("password p@ss-w0rd-sekrit leaked") == "password *** leaked"
    assert redact_url("http://plain:2") == "http://plain:2"
    with pytest.raises(ConfigError, match="credentials"):
        RouterConfig(backends=(with_credentials("http://h:1"),), kvtier_servers=(None,),
                     backend_api_key="k")
    with pytest.raises(ConfigError, match="credentials"):
        RouterConfig(backends=("http://h:1",), kvtier_servers=(with_credentials("http://n:1"),),
                     node_token="t")


class NodeApiStub:
    """A node server's HTTP API that answers only with the token, and records headers."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.seen: list[tuple[str, str | None]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> NodeApiStub:
        app = web.Application()
        app.router.add_get("/v1/namespaces", self._namespaces)
        app.router.add_post("/v1/lookup", self._lookup)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    def _ok(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization")
        self.seen.append((request.path, got))
        return got == f"Bearer {self.token}"

    async def _namespaces(self, request: web.Request) -> web.Response:
        if not self._ok(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response([{"namespace": NS.hex(), "chunk_tokens": 16, "model": "m",
                                   "tokenizer": "/nonexistent", "served_model_name": MODEL}])

    async def _lookup(self, request: web.Request) -> web.Response:
        if not self._ok(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        keys = (await request.json())["keys"]
        return web.json_response({"tiers": ["arena"] * len(keys),
                                  "arrival_s": [0.0] * len(keys)})


@pytest.mark.parametrize("token", [NODE_TOKEN, None])
def test_node_token_goes_with_every_node_call(token: str | None) -> None:
    async def main() -> None:
        node = await NodeApiStub(NODE_TOKEN).start()
        try:
            async with stubs(1) as backends, running_router(router_config(
                    backends, strategy="cache", kvtier_servers=[node.url],
                    node_token=token)) as router, aiohttp.ClientSession() as s:
                await asyncio.sleep(0.3)
                status, _doc, _ = await post(s, f"http://127.0.0.1:{router.port}/v1/completions",
                                             completion(list(range(64))))
                assert status == 200
                paths = {path for path, _ in node.seen}
                assert paths == {"/v1/namespaces", "/v1/lookup"} if token else \
                    paths == {"/v1/namespaces"}
                expected = f"Bearer {token}" if token else None
                assert all(got == expected for _, got in node.seen)
                reason = "affinity" if token else "no_keys"
                assert _sample(router, strategy="cache", reason=reason) == 1
        finally:
            assert node.runner is not None
            await node.runner.cleanup()
    asyncio.run(main())


def test_node_token_from_the_command_line(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.cli import build_parser

    parser = build_parser()
    monkeypatch.setenv("KVTIER_NODE_TOKEN", NODE_TOKEN)
    config = RouterConfig.from_args(parser.parse_args(["route", "--backends", "http://a:1"]))
    assert config.node_token == NODE_TOKEN and NODE_TOKEN not in repr(config)
    monkeypatch.delenv("KVTIER_NODE_TOKEN")
    config = RouterConfig.from_args(parser.parse_args(["route", "--backends", "http://a:1"]))
    assert config.node_token is None
    token_file = tmp_path / "token"
    token_file.write_text("from-file-token-0123456789\n")
    token_file.chmod(0o600)
    config = RouterConfig.from_args(parser.parse_args(
        ["route", "--backends", "http://a:1", "--node-token-file", str(token_file)]))
    assert config.node_token == "from-file-token-0123456789"
    token_file.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        RouterConfig.from_args(parser.parse_args(
            ["route", "--backends", "http://a:1", "--node-token-file", str(token_file)]))


def _sample(router: Any, **labels: str) -> float:
    return router.metrics.registry.get_sample_value("kvtier_router_decisions_total",
                                                    labels) or 0.0


def test_a_real_node_server_with_a_token_answers_the_router(tmp_path: Path) -> None:
    from store_helpers import SLOT_BYTES
    from stubs import EngineModel

    from kvtier.config import ServerConfig
    from kvtier.server import EmbeddedServer

    token_file = tmp_path / "node.token"
    token_file.write_text(NODE_TOKEN + "\n")
    token_file.chmod(0o600)
    node = EmbeddedServer(ServerConfig.from_dict({
        "socket_path": str(tmp_path / "kvtier.sock"), "metrics_port": 0,
        "arena": {"size_bytes": 64 * SLOT_BYTES, "slot_bytes": SLOT_BYTES, "free_target": 0.0},
        "auth": {"http_token_file": str(token_file)}})).start()

    async def main() -> None:
        engine = EngineModel(node, chunk_tokens=16, speed=20000)
        engine.register()
        node_url = f"http://127.0.0.1:{node.metrics_port}"
        for token, reasons in ((None, ["no_keys", "no_keys"]), (NODE_TOKEN, ["cold", "affinity"])):
            async with stubs(1) as backends, running_router(router_config(
                    backends, strategy="cache", kvtier_servers=[node_url],
                    node_token=token)) as router, aiohttp.ClientSession() as s:
                backends[0].engine = engine
                await asyncio.sleep(0.3)
                prompt = list(range(5000, 5064)) if token else list(range(64))
                for _ in reasons:
                    router.history.forget(0)  # only the node server's answer tells
                    status, _doc, _ = await post(
                        s, f"http://127.0.0.1:{router.port}/v1/completions", completion(prompt))
                    assert status == 200
                for reason in set(reasons):
                    assert _sample(router, strategy="cache", reason=reason) == \
                        reasons.count(reason)
    try:
        asyncio.run(main())
    finally:
        node.stop()
