"""``kvtier serve --instances N`` without engines: options, the shared tier spec, the router
command, the terminal summary, and child processes stopped by their ids."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import GiB, options, parse

from kvtier.cli import has_command, main
from kvtier.config import ServerConfig
from kvtier.errors import ConfigError
from kvtier.launch.front import check_router, router_argv
from kvtier.launch.shared_spec import shared_tier
from kvtier.launch.stack_options import StackOptions
from kvtier.launch.summary import tiers_line
from kvtier.processes import Child, group_members, stop_all
from kvtier.tiers import TIERS

# ---------------------------------------------------------------------- the shared tier


def test_a_folder_is_an_fs_tier(tmp_path: Path) -> None:
    tier = shared_tier(str(tmp_path / "s"), GiB)
    assert tier == {"type": "fs", "name": "shared", "capacity_bytes": GiB,
                    "options": {"path": str(tmp_path / "s")}}
    assert shared_tier(f"file://{tmp_path}/t", GiB)["options"]["path"] == f"{tmp_path}/t"  # type: ignore[index]
    ServerConfig.from_dict({"tiers": [tier]})
    assert shared_tier("none", GiB) is None and shared_tier("OFF", GiB) is None


def test_s3_and_redis_urls_map_to_their_tier_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.launch.shared_spec._check_type", lambda _t: None)
    s3 = shared_tier("s3://bucket/a/b?endpoint=http://127.0.0.1:8333&region=eu-1"
                     "&create_bucket=1&credentials=profile:dev", GiB)
    assert s3 == {"type": "s3", "name": "shared", "capacity_bytes": GiB, "options": {
        "bucket": "bucket", "prefix": "a/b/", "endpoint_url": "http://127.0.0.1:8333",
        "region": "eu-1", "create_bucket": True, "credentials": "profile:dev", "tls": False}}
    redis = shared_tier("rediss://cache.local:6380/2?key_prefix=kv:&password_env=PW", GiB)
    assert redis is not None and redis["type"] == "redis"
    assert redis["options"] == {"url": "rediss://cache.local:6380/2", "key_prefix": "kv:",
                                "password_env": "PW"}
    with pytest.raises(ConfigError, match="unknown parameter 'secret'"):
        shared_tier("s3://bucket/?secret=x", GiB)
    with pytest.raises(ConfigError, match="needs a bucket"):
        shared_tier("s3:///prefix", GiB)
    with pytest.raises(ConfigError, match="got a http:// URL"):
        shared_tier("http://example", GiB)


@pytest.mark.parametrize("kind", ["s3", "redis"])
def test_a_tier_type_this_kvtier_lacks_is_named(kind: str) -> None:
    spec = "s3://bucket/p" if kind == "s3" else "redis://127.0.0.1:6379/0"
    if kind in TIERS:
        assert shared_tier(spec, GiB)["type"] == kind  # type: ignore[index]
        assert options("--shared-local", kind).shared_local == kind
    else:
        with pytest.raises(ConfigError, match=f"no '{kind}' tier"):
            shared_tier(spec, GiB)
        with pytest.raises(ConfigError, match=f"no '{kind}' tier"):
            options("--shared-local", kind)


# ---------------------------------------------------------------------- options


def test_ports_follow_the_router_port_and_vllm_gets_the_rest() -> None:
    o = options("--port", "9000", "--host", "0.0.0.0", "--dtype", "float32")
    assert (o.port, o.host, o.instance_port(1), o.node_port(1)) == (9000, "0.0.0.0", 9002, 9102)
    assert o.vllm_args == ("--dtype", "float32")
    assert o.arena_bytes == 2 * GiB, "the default arena is split between the instances"
    assert options("--arena-size", "300MiB").arena_bytes == 300 << 20


@pytest.mark.parametrize("flag", [["--server-socket", "/s"], ["--log-file", "x"],
                                  ["--demo-request"], ["--kvtier-metrics-port", "1"]])
def test_single_instance_options_are_refused(flag: list[str]) -> None:
    with pytest.raises(ConfigError, match=f"{flag[0]} is for one instance"):
        options(*flag)


def test_bad_stack_options_fail_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--instances must be at least 1"):
        StackOptions.from_args(parse("--instances", "0"), GiB)
    with pytest.raises(ConfigError, match="not both"):
        options("--shared", str(tmp_path), "--shared-local", "redis")
    with pytest.raises(ConfigError, match="--shared: expected a folder"):
        options("--shared", "ftp://x")
    with pytest.raises(ConfigError, match="--router-policy: vllm-router knows"):
        check_router("vllm-router", "cache")
    if not has_command("route"):
        with pytest.raises(ConfigError, match="no `kvtier route` yet"):
            StackOptions.from_args(parse("--instances", "2"), GiB)


def test_router_command_lines() -> None:
    backends, nodes = ["http://a:1", "http://b:2"], ["http://a:9", "http://b:9"]
    assert router_argv("none", "", "127.0.0.1", 80, backends, nodes) is None
    kvtier = router_argv("kvtier", "cache", "127.0.0.1", 80, backends, nodes)
    assert kvtier is not None and kvtier[1:] == [
        "-m", "kvtier", "route", "--backends", "http://a:1,http://b:2", "--kvtier-servers",
        "http://a:9,http://b:9", "--strategy", "cache", "--host", "127.0.0.1", "--port", "80"]


def test_router_args_go_last_on_the_routers_command_line() -> None:
    o = options("--router", "kvtier", "--router-arg=--decode-weight=0",
                "--router-arg=--lookup-timeout-s=0.2")
    assert o.router_args == ("--decode-weight=0", "--lookup-timeout-s=0.2")
    argv = router_argv(o.router, o.policy, o.host, o.port, ["http://a:1"], ["http://a:9"],
                       extra=o.router_args)
    assert argv is not None and argv[-2:] == ["--decode-weight=0", "--lookup-timeout-s=0.2"]
    assert options().router_args == ()


@pytest.mark.parametrize(("argv", "said"), [
    (["--router", "kvtier", "--router-arg=--port=9"],
     "--router-arg --port=9: the stack sets --port itself"),
    (["--router", "kvtier", "--router-arg=--strategy=session"], "sets --strategy itself"),
    (["--router-arg=--decode-weight=0"], "there is no router with --router none"),
    (["--router", "kvtier", "--router-arg=--no-such-flag"],
     "kvtier route refuses '--no-such-flag': .*unrecognized arguments: --no-such-flag"),
    (["--router", "kvtier", "--router-arg=--decode-weight=-1"],
     "--decode-weight: must be between 0 and 100"),
])
def test_router_args_the_router_would_refuse_fail_before_anything_starts(
        argv: list[str], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        options(*argv)


def test_dry_run_prints_each_instance(capsys: pytest.CaptureFixture[str], tmp_path: Path
                                      ) -> None:
    rc = main(["serve", "--instances", "2", "--router", "none", "--run-dir", str(tmp_path),
               "--port", "7000", "--dry-run", "--dtype", "float32"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 2
    assert f"--server-config {tmp_path}/instance-1.yaml --log-file -" in lines[1]
    assert lines[1].endswith("--port 7002 --host 127.0.0.1 --dtype float32")


def test_on_the_cpu_build_each_instance_runs_wholly_on_its_own_core(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's worker threads (the variable) and every process of the instance (its CPU
    affinity, which what it starts inherits), round robin over the CPUs this one may use."""
    from kvtier.launch.stack import Stack

    monkeypatch.setattr("kvtier.launch.plan.is_cpu_build", lambda: True)
    monkeypatch.setattr("kvtier.launch.plan.allowed_cpus", lambda: [4, 5])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    stack = Stack(options("--instances", "3", "--run-dir", str(tmp_path)))
    parts = [stack.instance_part(i) for i in range(3)]
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in parts if p.env] == ["4", "5", "4"]
    assert [p.cpus for p in parts] == [{4}, {5}, {4}]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user binds: left alone
    part = stack.instance_part(0)
    assert part.cpus is None and part.env and part.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_the_summary_names_tiers_without_secrets() -> None:
    config = ServerConfig.from_dict({"arena": {"size_bytes": "1536MiB"}, "tiers": [
        {"type": "disk", "capacity_bytes": "20GiB", "options": {"path": "/d"}},
        {"type": "fs", "name": "shared", "capacity_bytes": "1TiB", "options": {"path": "/n"}}]})
    assert tiers_line(config) == ("arena 1.5 GiB (host RAM) -> disk 20 GiB in /d -> "
                                  "fs 'shared' 1024 GiB in /n")
    from kvtier.launch.summary import tier_where

    assert tier_where("redis", {"url": "redis://u:pw@h:1/0"}) == "redis://h:1/0"


# ---------------------------------------------------------------------- children


def test_stopping_a_child_leaves_nothing_in_its_group(tmp_path: Path) -> None:
    # a child that ignores SIGTERM and leaves a grandchild behind
    script = "trap '' TERM; sleep 300 & sleep 300"
    child = Child.start("stubborn", ["bash", "-c", script], tmp_path / "c.log")
    time.sleep(0.3)
    assert len(group_members(child.pid)) >= 2
    started = time.monotonic()
    stop_all([child], timeout_s=1.0)
    assert time.monotonic() - started < 10
    assert group_members(child.pid) == []
    assert not child.running


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from kvtier.processes import "
            "Child; c = Child.start('s', ['sleep', '300'], Path(sys.argv[1])); "
            "print(c.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "s.log")],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_members(pid) == [], "PDEATHSIG: the child went with its parent"
