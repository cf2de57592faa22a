"""The node token outside the node server: ``kvtier verify`` sends it to the node servers
(and only to them), and ``kvtier serve`` / ``--instances`` hand it to every node server, the
router and verify — never writing or printing the token itself."""

from __future__ import annotations

import argparse
import json
import secrets
from pathlib import Path

import pytest
from store_helpers import MakeServer, keys

from kvtier.cli import main
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.launch.front import router_argv
from kvtier.launch.stack import Stack
from kvtier.launch.stack_options import StackOptions
from kvtier.verify.cli import node_token
from kvtier.verify.run import Verification, VerifyOptions

from .test_verify_units import _KeyCheckingEntry

GiB = 1 << 30
ENV = "KVTIER_NODE_TOKEN"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = secrets.token_hex(16)
    monkeypatch.setenv(ENV, value)
    return value


@pytest.fixture
def token_file(tmp_path: Path) -> tuple[Path, str]:
    value = secrets.token_hex(16)
    path = tmp_path / "node-token"
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path, value


# ---------------------------------------------------------------------- kvtier verify

def test_verify_sends_the_node_token_to_node_servers_only(
        make_server: MakeServer, token: str, capsys: pytest.CaptureFixture[str]) -> None:
    # asks for $KVTIER_NODE_TOKEN (the default), for /metrics too
    node = make_server(metrics_port=0, auth={"metrics_need_token": True})
    with KvtierClient(node.socket_path) as client:
        client.lookup(keys(1))  # so its /metrics counts a lookup
    entry = _KeyCheckingEntry()  # the entry point and the instance's vLLM
    try:
        url = f"http://127.0.0.1:{node.metrics_port}"
        lines: list[str] = []
        without = Verification(VerifyOptions(url=entry.url, kvtier_servers=(url,),
                                             backends=(entry.url,)), say=lines.append)
        assert not without.entry_point()
        assert "401, no node token" in lines[-1] and "--node-token-env" in lines[-1]
        lines.clear()
        options = VerifyOptions(url=entry.url, kvtier_servers=(url,), backends=(entry.url,),
                                node_token=token)
        assert token not in repr(options)
        verification = Verification(options, say=lines.append)
        assert verification.entry_point(), lines
        sample = verification.views[0].sample()
        assert sample.get("kvtier_request_seconds_count|lookup") == 1.0, \
            "the node's /metrics was read, with the token"
        assert token not in " ".join(lines)
        assert all(token not in seen for seen in entry.seen), "never sent to the entry point"
        # the command line: the token from the environment by default, never printed
        assert main(["verify", "--url", entry.url, "--kvtier-servers", url]) == 1
        out = capsys.readouterr()
        assert "[1/5] entry point      ok" in out.out and token not in out.out + out.err
        assert main(["verify", "--url", entry.url, "--kvtier-servers", url,
                     "--node-token-env", "KVTIER_TEST_NO_SUCH_TOKEN"]) == 1
        assert "401, no node token" in capsys.readouterr().out
    finally:
        entry.close()


def _verify_args(*argv: str) -> argparse.Namespace:
    from kvtier.verify.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["verify", *argv])


def test_where_verify_finds_the_node_token(token: str, token_file: tuple[Path, str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path, in_file = token_file
    stack = {"node_token": {"file": str(path)}}
    assert node_token(_verify_args()) == token, "$KVTIER_NODE_TOKEN by default"
    assert node_token(_verify_args(), stack) == in_file, "the file the stack was started with"
    assert node_token(_verify_args("--node-token-env", ENV), stack) == token
    assert node_token(_verify_args("--node-token-file", str(path))) == in_file
    monkeypatch.setenv("OTHER_TOKEN", "a,b")
    assert node_token(_verify_args("--node-token-env", "OTHER_TOKEN")) == "a", "first entry"
    monkeypatch.delenv(ENV)
    assert node_token(_verify_args()) is None
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        node_token(_verify_args("--node-token-file", str(path)))
    with pytest.raises(SystemExit):
        _verify_args("--node-token-env", ENV, "--node-token-file", str(path))


# ---------------------------------------------------------------------- kvtier serve

def _parse(*argv: str) -> argparse.Namespace:
    from kvtier.launch.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _stack(*argv: str) -> Stack:
    return Stack(StackOptions.from_args(_parse("--instances", "2", "--router", "none", *argv),
                                        4 * GiB))


def test_a_stack_with_a_token_file_guards_every_node_server(token_file: tuple[Path, str],
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.delenv(ENV, raising=False)
    path, value = token_file
    stack = _stack("--node-token-file", str(path))
    assert stack.o.node_token() == value
    for i in range(2):
        config = ServerConfig.from_dict(stack.server_config(i))
        assert config.auth.http_token_file == str(path)
    argv = router_argv("kvtier", "cache", "127.0.0.1", 80, ["http://a:1"], ["http://a:9"],
                       path.parent, node_token_file=stack.o.node_token_file)
    assert argv is not None and argv[-2:] == ["--node-token-file", str(path)]
    state = json.dumps(stack.state())
    assert json.loads(state)["node_token"] == {"file": str(path)} and value not in state


def test_a_stack_passes_the_token_from_the_environment(token: str) -> None:
    stack = _stack()
    assert stack.o.node_token() == token
    assert "auth" not in stack.server_config(0), "the default auth.http_token_env reads it"
    assert stack.instance_env(0)[ENV] == token, "every instance inherits it"
    state = json.dumps(stack.state())
    assert json.loads(state)["node_token"] == {"env": ENV} and token not in state


def test_a_stack_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    stack = _stack()
    assert stack.o.node_token() is None and stack.state()["node_token"] is None


def test_a_bad_token_file_fails_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "open-token"
    path.write_text(secrets.token_hex(16))
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        _stack("--node-token-file", str(path))
    with pytest.raises(ConfigError, match="cannot open"):
        _stack("--node-token-file", str(tmp_path / "missing"))


def test_one_serve_hands_the_token_file_to_its_node_server(
        token_file: tuple[Path, str], tmp_path: Path) -> None:
    from kvtier.launch.serve import build_plan

    path, value = token_file
    plan = build_plan(_parse("--model", str(tmp_path), "--node-token-file", str(path)))
    transfer = json.loads(plan.cmd[plan.cmd.index("--kv-transfer-config") + 1])
    server = transfer["kv_connector_extra_config"]["server"]  # no config.json: vLLM embeds it
    assert server["auth"] == {"http_token_file": str(path)}
    assert value not in " ".join(plan.cmd)
    with pytest.raises(ConfigError, match="--node-token-file is for the node server"):
        build_plan(_parse("--model", str(tmp_path), "--server-socket", "/s",
                          "--node-token-file", str(path)))
