"""The node HTTP API beyond loopback: refused without a token unless explicitly allowed, and
the address it advertises (``/healthz``'s ``url``), never a wildcard."""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from pathlib import Path

import pytest
from store_helpers import MakeServer, server_config

from kvtier.address import advertised_host, check_exposure, is_loopback, url
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.server import EmbeddedServer

TOKEN_ENV = "KVTIER_TEST_ADDRESS_TOKEN"


def config(tmp_path: Path, **extra: object) -> ServerConfig:
    auth = {"http_token_env": TOKEN_ENV, **extra.pop("auth", {})}  # type: ignore[dict-item]
    return server_config(tmp_path, metrics_port=0, auth=auth, **extra)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.3", "::1", "[::1]", "localhost"])
def test_loopback_addresses_are_loopback(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "node-1",
                                  "node-1.cluster.local", "fe80::1",
                                  "localhost.localdomain", "ip6-localhost"])
def test_anything_else_counts_as_reachable_from_other_hosts(host: str) -> None:
    assert not is_loopback(host)


def test_a_wildcard_bind_needs_an_advertised_host(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics_advertise_host"):
        config(tmp_path, metrics_host="0.0.0.0")
    with pytest.raises(ConfigError, match="not an address others can reach"):
        config(tmp_path, metrics_host="10.0.0.5", metrics_advertise_host="0.0.0.0")
    with pytest.raises(ConfigError, match="metrics_advertise_host: expected a host name"):
        config(tmp_path, metrics_host="0.0.0.0", metrics_advertise_host="http://a:1/")
    with pytest.raises(ConfigError, match="metrics_host: expected a host name"):
        config(tmp_path, metrics_host="10.0.0.5:80")
    ok = config(tmp_path, metrics_host="::", metrics_advertise_host="fd00::7")
    assert advertised_host(ok) == "fd00::7" and url("fd00::7", 81) == "http://[fd00::7]:81"
    assert advertised_host(config(tmp_path, metrics_host="10.1.2.3")) == "10.1.2.3"
    # without an HTTP API nothing is bound, so nothing needs advertising
    assert server_config(tmp_path, metrics_host="0.0.0.0").metrics_port is None


@pytest.mark.parametrize(("given", "bound"), [
    ("[::1]", "::1"), ("[::]", "::"), ("::ffff:0.0.0.0", "0.0.0.0"), (" 10.0.0.5 ", "10.0.0.5"),
    ("node-1", "node-1")])
def test_hosts_are_normalised_once_for_the_bind(tmp_path: Path, given: str, bound: str) -> None:
    extra = {"metrics_advertise_host": "10.0.0.5"}
    made = config(tmp_path, metrics_host=given, **extra)
    assert made.metrics_host == bound


@pytest.mark.parametrize("host", ["::ffff:0.0.0.0", "[::]", ""])
def test_every_spelling_of_a_wildcard_needs_an_advertised_host(
        tmp_path: Path, host: str) -> None:
    with pytest.raises(ConfigError, match="metrics_advertise_host"):
        config(tmp_path, metrics_host=host)


@pytest.mark.parametrize(("host", "why"), [
    ("0", "short or non-decimal"), ("0x0", "short or non-decimal"),
    ("127.1", "short or non-decimal"), ("*", "expected a host name"),
    ("[::1]:80", "expected a host name")])
def test_hosts_the_c_library_reads_differently_are_refused(
        tmp_path: Path, host: str, why: str) -> None:
    with pytest.raises(ConfigError, match=f"metrics_host: .*{why}"):
        config(tmp_path, metrics_host=host, metrics_advertise_host="10.0.0.5")
    with pytest.raises(ConfigError, match=f"metrics_advertise_host: .*{why}"):
        config(tmp_path, metrics_host="0.0.0.0", metrics_advertise_host=host)


def test_beyond_loopback_without_a_token_is_refused_before_anything_binds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    exposed = config(tmp_path, metrics_host="0.0.0.0", metrics_advertise_host="10.0.0.5")
    server = EmbeddedServer(exposed)
    with pytest.raises(ConfigError, match=r"is not loopback.*node token.*"
                       r"allow_remote_http_without_token"):
        server.start()
    assert not os.path.exists(exposed.socket_path)  # refused before the socket was bound
    assert server.store is None and server.metrics_port is None
    allowed = config(tmp_path, metrics_host="10.0.0.5",
                     auth={"allow_remote_http_without_token": True})
    check_exposure(allowed, has_token=False)
    check_exposure(exposed, has_token=True)
    check_exposure(config(tmp_path), has_token=False)  # loopback: no token needed


def test_healthz_tells_the_advertised_url(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0, metrics_advertise_host="node-7.kvtier.test")
    assert server.http_url == f"http://node-7.kvtier.test:{server.metrics_port}"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/healthz",
                                timeout=5) as answer:
        doc = json.loads(answer.read())
    assert doc["ok"] and doc["url"] == server.http_url
    plain = make_server(metrics_port=0, socket_path=str(Path(server.socket_path).parent
                                                        / "second.sock"))
    assert plain.http_url == f"http://127.0.0.1:{plain.metrics_port}"


def _serve_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    from kvtier.launch.serve import register

    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64}))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", str(model), "--arena-size", "64MiB",
                              "--no-disk", *extra])


def test_kvtier_serve_binds_a_host_address_only_with_a_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.launch.serve import build_plan

    monkeypatch.delenv("KVTIER_NODE_TOKEN", raising=False)
    exposed = ("--kvtier-metrics-host", "0.0.0.0", "--kvtier-advertise-host", "10.0.0.5",
               "--kvtier-metrics-port", "8100", "--host", "0.0.0.0")
    with pytest.raises(ConfigError, match="not loopback"):
        build_plan(_serve_args(tmp_path, *exposed))
    with pytest.raises(ConfigError, match="--kvtier-metrics-port"):
        build_plan(_serve_args(tmp_path, "--kvtier-metrics-host", "10.0.0.5"))
    with pytest.raises(ConfigError, match="metrics_advertise_host"):
        build_plan(_serve_args(tmp_path, "--kvtier-metrics-host", "0.0.0.0",
                               "--kvtier-metrics-port", "8100"))
    plan = build_plan(_serve_args(tmp_path, *exposed, "--allow-remote-http-without-token"))
    assert plan.server is not None and plan.server.metrics_host == "0.0.0.0"
    assert plan.cmd[-2:] == ["--host", "0.0.0.0"]  # vLLM's own API binds it too
    monkeypatch.setenv("KVTIER_NODE_TOKEN", "t" * 32)
    plan = build_plan(_serve_args(tmp_path, *exposed))
    assert plan.server is not None and plan.server.metrics_advertise_host == "10.0.0.5"
    assert plan.base_url == "http://127.0.0.1:8000"  # what this process checks vLLM on


def test_the_one_machine_stack_keeps_its_node_servers_on_loopback(tmp_path: Path) -> None:
    from kvtier.launch.stack_options import StackOptions

    for flag in (("--kvtier-metrics-host", "10.0.0.5"),
                 ("--kvtier-advertise-host", "10.0.0.5"),
                 ("--allow-remote-http-without-token",)):
        with pytest.raises(ConfigError, match="is for one instance"):
            StackOptions.from_args(_serve_args(tmp_path, "--instances", "2", *flag), 1 << 30)


def test_an_ipv6_bind_is_served_and_advertised_in_brackets(make_server: MakeServer) -> None:
    import socket

    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    finally:
        probe.close()
    server = make_server(metrics_port=0, metrics_host="::1")
    assert server.http_url == f"http://[::1]:{server.metrics_port}"
    with urllib.request.urlopen(f"{server.http_url}/healthz", timeout=5) as answer:
        assert json.loads(answer.read())["url"] == server.http_url


def test_kvtier_server_refuses_an_open_host_bind_with_a_clear_error(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({
        "socket_path": str(tmp_path / "s.sock"), "arena": {"size_bytes": 64 << 20},
        "metrics_port": 0, "metrics_host": "0.0.0.0", "metrics_advertise_host": "10.0.0.5",
        "auth": {"http_token_env": TOKEN_ENV}}))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    run = subprocess.run([sys.executable, "-m", "kvtier", "server", "--config", str(config)],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 2
    assert "metrics_host '0.0.0.0' is not loopback" in run.stderr
    assert f"${TOKEN_ENV}" in run.stderr and "allow_remote_http_without_token" in run.stderr
    assert not (tmp_path / "s.sock").exists()
