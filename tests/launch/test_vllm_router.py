"""``--router vllm-router`` finds vllm-router and never installs it: an explicit path
(``--vllm-router``, ``$KVTIER_VLLM_ROUTER``), then the peers virtualenv that ``kvtier bench
peers --install vllm-router`` fills, then PATH; none, or a bad explicit one, fails before
anything starts and says how to install it. With ``kv_aware`` the stack wires each instance's
KV events to it through the relay (:mod:`kvtier.launch.kv_events`). Real files and a real
``kvtier serve`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import options

from kvtier.cli import build_parser
from kvtier.errors import ConfigError
from kvtier.launch.front import KvEventSources, router_argv
from kvtier.launch.stack import Stack
from kvtier.launch.vllm_router import ENV, INSTALL, find_vllm_router, vllm_router_binary


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory and a PATH with no vllm-router in either; returns the PATH folder."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(ENV, raising=False)
    empty = tmp_path / "path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty


def test_none_found_names_how_to_install_it(nowhere: Path) -> None:
    with pytest.raises(ConfigError, match="no vllm-router found") as info:
        find_vllm_router()
    assert INSTALL in str(info.value) and "--vllm-router PATH" in str(info.value)
    with pytest.raises(ConfigError, match="no vllm-router found"):
        options("--router", "vllm-router")


def test_the_peers_venv_comes_before_path(tmp_path: Path, nowhere: Path) -> None:
    on_path = executable(nowhere / "vllm-router")
    assert find_vllm_router() == on_path
    venv = executable(vllm_router_binary())
    assert str(venv).startswith(str(tmp_path / "cache" / "peers"))
    assert find_vllm_router() == venv


def test_an_explicit_path_wins_and_is_never_passed_over(tmp_path: Path, nowhere: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    executable(vllm_router_binary())
    mine = executable(tmp_path / "mine" / "router")
    assert find_vllm_router(str(mine)) == mine
    monkeypatch.setenv(ENV, str(mine))
    assert find_vllm_router() == mine
    with pytest.raises(ConfigError, match=r"--vllm-router: .* is not an executable file"):
        find_vllm_router(str(tmp_path / "missing"))
    monkeypatch.setenv(ENV, str(tmp_path / "mine"))  # a folder
    with pytest.raises(ConfigError, match=rf"\${ENV}: .* is not an executable file"):
        find_vllm_router()
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")  # not executable
    with pytest.raises(ConfigError, match="is not an executable file"):
        find_vllm_router(str(plain))


def test_the_stack_runs_the_router_it_found(tmp_path: Path, nowhere: Path) -> None:
    mine = executable(tmp_path / "vllm-router")
    o = options("--router", "vllm-router", "--vllm-router", str(mine))
    assert o.vllm_router == mine
    argv = router_argv(o.router, o.policy, o.host, o.port, ["http://a:1"], ["http://a:9"],
                       o.vllm_router)
    assert argv is not None and argv[0] == str(mine)
    assert argv[argv.index("--policy") + 1] == "round_robin"
    # its metrics on a planned port: its fixed default (29000) was once a SeaweedFS's
    assert argv[argv.index("--prometheus-port") + 1] == str(o.port + 100)
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert o.instance_ports()["vllm-router's metrics"] == o.port + 100
    assert options().vllm_router is None
    with pytest.raises(ConfigError, match="--vllm-router is for --router vllm-router"):
        options("--vllm-router", str(mine))


def test_kvtier_serve_fails_before_anything_starts_and_installs_nothing(
        tmp_path: Path, nowhere: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PATH": str(nowhere)}
    done = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--instances", "2",
                           "--router", "vllm-router", "--run-dir", str(run_dir)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert INSTALL in done.stderr
    assert not run_dir.exists(), "nothing was started"
    assert not (tmp_path / "cache" / "peers").exists(), "nothing was installed"


def test_the_install_command_is_registered() -> None:
    from kvtier.bench import peers

    args = build_parser().parse_args(INSTALL.split()[1:])
    assert args.func is peers.run and args.install == "vllm-router"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "peers", "--install", "nope"])


def test_kv_aware_gets_each_instances_relayed_events(tmp_path: Path, nowhere: Path) -> None:
    mine = executable(tmp_path / "vllm-router")
    o = options("--router", "vllm-router", "--router-policy", "kv_aware", "--vllm-router",
                str(mine), "--port", "9000", "--served-model-name", "chat", "--block-size",
                "16")
    assert o.kv_events and not options("--router", "vllm-router", "--vllm-router",
                                       str(mine)).kv_events
    assert o.instance_ports()["instance 1's KV-event relay"] == 9202
    stack = Stack(o)
    sources = stack.kv_event_sources()
    assert sources == KvEventSources(("tcp://127.0.0.1:9201", "tcp://127.0.0.1:9202"), 16,
                                     "chat")
    argv = router_argv(o.router, o.policy, o.host, o.port,
                       [stack.url(0), stack.url(1)], [], o.vllm_router, kv_events=sources)
    assert argv is not None
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert pairs == ["http://127.0.0.1:9001=tcp://127.0.0.1:9201",
                     "http://127.0.0.1:9002=tcp://127.0.0.1:9202"]
    assert argv[argv.index("--kv-event-block-size") + 1] == "16"
    assert argv[argv.index("--kv-event-model") + 1] == "chat"
    events = stack.instance_argv(1)[stack.instance_argv(1).index("--kv-events-config") + 1]
    assert stack.kv_event_endpoint(1).startswith("ipc://") and stack.kv_event_endpoint(1) in events
    # vLLM's default topic: the only one vllm-router's static sources take in (none other is
    # settable; under "kv-events" it dropped every message and credited no prefix)
    assert json.loads(events)["topic"] == ""
    assert "--kv-events-config" not in Stack(options()).instance_argv(0)
    with pytest.raises(ConfigError, match="kv_aware needs the instances' KV-event sources"):
        router_argv(o.router, o.policy, o.host, o.port, ["http://a:1"], [], o.vllm_router)


def test_kv_aware_refuses_what_would_break_its_wiring(tmp_path: Path, nowhere: Path) -> None:
    mine = executable(tmp_path / "vllm-router")
    kv = ("--router", "vllm-router", "--router-policy", "kv_aware", "--vllm-router", str(mine))
    with pytest.raises(ConfigError, match="--kv-events-config: kvtier serve sets"):
        options(*kv, "--kv-events-config", '{"enable_kv_cache_events": true}')
    with pytest.raises(ConfigError, match="KV-event relay would listen on 65536"):
        options(*kv, "--port", "65334")
    options("--router", "vllm-router", "--vllm-router", str(mine), "--port", "65334")
