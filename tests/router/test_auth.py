"""API keys: clients need the router's key (401 before any backend is touched), backends get
theirs (health checks too), and no key is ever logged."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
from stubs import completion, post, router_config, running_router, stubs

from kvtier.errors import ConfigError
from kvtier.router.config import RouterConfig, read_key

CLIENT_KEY = "client-sekrit-0123456789"
BACKEND_KEY = "backend-sekrit-9876543210"


def test_missing_or_wrong_key_gets_401_and_the_backend_sees_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        async with stubs(2, api_key=BACKEND_KEY) as backends, running_router(router_config(
                backends, api_key=CLIENT_KEY, backend_api_key=BACKEND_KEY)) as router, \
                aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{router.port}"
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": f"Basic {CLIENT_KEY}"},
                            {"Authorization": f"Bearer {CLIENT_KEY}x"}):
                status, doc, _ = await post(s, f"{url}/v1/completions", completion(), headers)
                assert status == 401 and "API key" in doc["error"]["message"]
                async with s.get(f"{url}/v1/models", headers=headers) as resp:
                    assert resp.status == 401
            assert all(b.seen == [] for b in backends), "nothing reached a backend"
            good = {"Authorization": f"Bearer {CLIENT_KEY}"}
            status, doc, _ = await post(s, f"{url}/v1/completions", completion(), good)
            assert status == 200, doc
            async with s.get(f"{url}/v1/models", headers=good) as resp:
                assert resp.status == 200
            async with s.get(f"{url}/health") as resp:
                assert resp.status == 200, "/health needs no key"
            sent = next(b.seen[0] for b in backends if b.seen)
            assert sent["headers"]["Authorization"] == f"Bearer {BACKEND_KEY}", \
                "the backend's key replaces the client's"
            for b in backends:
                assert b.health_headers, "health checks ran"
                assert all(h.get("Authorization") == f"Bearer {BACKEND_KEY}"
                           for h in b.health_headers)
            refused = router.metrics.registry.get_sample_value(
                "kvtier_router_refused_total", {"reason": "unauthorized"})
            assert refused == 8
    asyncio.run(main())
    text = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert caplog.records, "something was logged at DEBUG"
    assert CLIENT_KEY not in text and BACKEND_KEY not in text


def test_backends_without_their_key_are_out() -> None:
    async def main() -> None:
        async with stubs(1, api_key=BACKEND_KEY) as backends, running_router(
                router_config(backends)) as router, aiohttp.ClientSession() as s:
            assert not router.pool.backends[0].healthy
            status, _doc, _ = await post(s, f"http://127.0.0.1:{router.port}/v1/completions",
                                        completion())
            assert status == 503 and backends[0].seen == []
    asyncio.run(main())


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(CLIENT_KEY + "\n")
    assert read_key(None, str(key_file), "--api-key") == CLIENT_KEY
    monkeypatch.setenv("ROUTER_KEY", BACKEND_KEY)
    assert read_key("ROUTER_KEY", None, "--backend-api-key") == BACKEND_KEY
    with pytest.raises(ConfigError, match="--api-key-env: environment variable NOPE"):
        read_key("NOPE", None, "--api-key")
    with pytest.raises(ConfigError, match="--api-key-file: cannot read"):
        read_key(None, str(tmp_path / "missing"), "--api-key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_key(None, str(tmp_path / "empty"), "--api-key")
    config = RouterConfig(backends=("http://a:1",), kvtier_servers=(None,), api_key=CLIENT_KEY)
    assert CLIENT_KEY not in repr(config) and CLIENT_KEY not in str(config)


def test_command_line_never_takes_a_key_itself() -> None:
    from kvtier.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["route", "--backends", "http://a:1", "--api-key", CLIENT_KEY])
    args = parser.parse_args(["route", "--backends", "http://a:1,http://b:2/",
                              "--kvtier-servers", "http://a:9,http://b:9"])
    assert isinstance(args, argparse.Namespace)
    config = RouterConfig.from_args(args)
    assert config.backends == ("http://a:1", "http://b:2")
    with pytest.raises(ConfigError, match="2 URLs for 1 backends"):
        RouterConfig.from_args(parser.parse_args(
            ["route", "--backends", "http://a:1", "--kvtier-servers", "http://a:9,http://b:9"]))
    with pytest.raises(ConfigError, match="not an http"):
        RouterConfig.from_args(parser.parse_args(["route", "--backends", "a:1"]))
    from kvtier.cli import main

    assert main(["route", "--backends", "a:1"]) == 2, "a bad option: exit 2, no traceback"
