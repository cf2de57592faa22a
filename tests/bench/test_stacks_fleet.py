"""The plain-fleet configurations: N plain vLLM instances (no kvtier) behind a router.

Built dry (the process specs, nothing started): each instance runs the ``device``
configuration's vLLM command on its own port and core, the router fronts them all, and
``kvtier route`` accepts the command line it is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvtier.bench import stacks
from kvtier.bench.stacks import StackEnv, plain_fleet_specs
from kvtier.cli import build_parser, main


@pytest.fixture
def env(tmp_path: Path) -> StackEnv:
    return StackEnv(model="/models/m", served_name="m", engine_args=("--dtype", "bfloat16"),
                    workdir=tmp_path / "w")


@pytest.fixture
def cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvtier.launch.plan.is_cpu_build", lambda: True)
    monkeypatch.setattr("kvtier.launch.plan.allowed_cpus", lambda: [0, 1])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)


def test_each_instance_is_plain_vllm_on_its_own_port_and_core(env: StackEnv,
                                                              cpu_build: None) -> None:
    specs = plain_fleet_specs(env, 2, "vllm-router", "round_robin", 30000,
                              Path("/peers/vllm-router"))
    assert [s.name for s in specs] == ["vllm-0", "vllm-1", "router-vllm-router"]
    for i, spec in enumerate(specs[:2]):
        port = 30001 + i
        assert spec.argv == stacks._vllm(env, port)  # the `device` configuration's command
        assert spec.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert "--kv-transfer-config" not in spec.argv and "kvtier" not in " ".join(spec.argv)
        assert spec.argv[-2:] == ["--dtype", "bfloat16"]
        assert spec.env == {"VLLM_CPU_OMP_THREADS_BIND": str(i)}
        assert spec.cpus == {i}  # all its processes, not only vLLM's worker threads


def test_vllm_router_fronts_the_instances_round_robin(env: StackEnv, cpu_build: None) -> None:
    router = plain_fleet_specs(env, 2, "vllm-router", "round_robin", 30000,
                               Path("/peers/vllm-router"))[-1]
    argv = router.argv
    assert argv[0] == "/peers/vllm-router"
    assert argv[argv.index("--port") + 1] == "30000" and "127.0.0.1" in argv
    at = argv.index("--worker-urls")
    assert argv[at + 1:at + 3] == ["http://127.0.0.1:30001", "http://127.0.0.1:30002"]
    assert argv[argv.index("--policy") + 1] == "round_robin"


def test_kvtier_route_fronts_the_instances_round_robin_without_node_servers(
        env: StackEnv, cpu_build: None) -> None:
    router = plain_fleet_specs(env, 3, "kvtier", "roundrobin", 30000)[-1]
    argv = router.argv
    assert argv[:4] == [sys.executable, "-m", "kvtier", "route"]
    assert argv[argv.index("--backends") + 1] == ",".join(
        f"http://127.0.0.1:{30001 + i}" for i in range(3))
    assert argv[argv.index("--strategy") + 1] == "roundrobin"
    # kvtier route itself accepts it: three backends, none with a node server
    from kvtier.router.config import RouterConfig

    args = build_parser().parse_args(argv[3:])
    config = RouterConfig.from_args(args)
    assert len(config.backends) == 3 and config.kvtier_servers == (None, None, None)
    assert config.strategy == "roundrobin" and config.port == 30000


def test_a_core_set_by_hand_is_left_alone(env: StackEnv, cpu_build: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    specs = plain_fleet_specs(env, 2, "kvtier", "roundrobin", 30000)
    assert all(s.env == {} and s.cpus is None for s in specs)


def test_instances_wrap_around_the_cores(env: StackEnv, cpu_build: None) -> None:
    specs = plain_fleet_specs(env, 3, "kvtier", "roundrobin", 30000)
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs[:3]] == ["0", "1", "0"]
    assert [s.cpus for s in specs] == [{0}, {1}, {0}, None]  # the router runs anywhere


def test_a_plain_fleet_needs_a_router(env: StackEnv) -> None:
    with pytest.raises(stacks.ConfigError, match="needs a router"):
        plain_fleet_specs(env, 2, "none", "", 30000)


def test_the_plain_fleet_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sweep", "--list-configs"]) == 0
    out = capsys.readouterr().out
    for name in ("2x-plain+vllm-router", "2x-plain+kvtier-rr", "device", "2x+cache"):
        line = next(li for li in out.splitlines() if li.split()[0] == name)
        assert len(line.split()) > 3  # with its description
    assert "no kvtier" in next(li for li in out.splitlines()
                               if li.startswith("2x-plain+kvtier-rr"))


def test_the_fleet_stacks_differ_only_in_their_shared_tier(
        env: StackEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """``2x-noshare+...``: the same two-instance stack as ``2x+...`` without the shared tier
    (routing is then the only way to reuse), ``2x-s3+...`` with a slow one; the same router
    and strategy."""
    argvs: list[list[str]] = []

    def launch(_env: StackEnv, specs: list[stacks.ProcSpec], port: int) -> stacks.StartedConfig:
        argvs.append(specs[0].argv)
        return stacks.StartedConfig(f"http://127.0.0.1:{port}", [])

    monkeypatch.setattr(stacks, "launch", launch)
    names = ("2x+cache", "2x-noshare+cache", "2x-noshare+roundrobin", "2x-s3+cache")
    for name in names:
        stacks.get_stack(name).start(env)
    shared, alone, alone_rr, s3 = argvs
    from kvtier.launch.stack_options import StackOptions

    def options(argv: list[str]) -> StackOptions:
        """What kvtier serve itself makes of the command line."""
        return StackOptions.from_args(build_parser().parse_args(argv[3:]), 1 << 30)

    assert options(shared).shared_tier() == {
        "type": "fs", "name": "shared", "capacity_bytes": env.disk_bytes,
        "options": {"path": str(env.workdir / "shared")}}
    for argv in (alone, alone_rr):
        assert options(argv).shared_tier() is None  # not the default folder: it outlives runs
        assert argv[argv.index("--instances") + 1] == "2"
    assert options(s3).shared_local == "s3"  # a SeaweedFS of the stack's own, in its run dir
    assert options(s3).run_dir == env.workdir / "stack"
    policy = [a[a.index("--router-policy") + 1] for a in argvs]
    assert policy == ["cache", "cache", "roundrobin", "cache"]
