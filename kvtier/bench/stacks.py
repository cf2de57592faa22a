"""Serving stacks a sweep starts and stops: a small registry of configurations.

A configuration is a name, a line of description and a *starter*: a function that takes the
settings every configuration shares (:class:`StackEnv`: model, engine flags, sizes, a fresh
work folder) and returns a :class:`StartedConfig` (its URL and processes). Adding one is a
few lines::

    def _start_mine(env: StackEnv) -> StartedConfig:
        port = free_port()
        return launch(env, [engine(env, "vllm", [...vLLM command...], port)], port)

    register_stack("mine", "what it is", _start_mine)

Every process runs in its own session (process group) with its output in the work folder
(:class:`kvtier.processes.Child`); ``StartedConfig.stop`` sends SIGTERM to each group it
started (last started first), whether or not its leader is still alive, and SIGKILL to what
is left after a grace period. (Not to be confused with :class:`kvtier.launch.stack.Stack`,
the supervised stack of ``kvtier serve --instances``, which a configuration may start.)
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier import ports
from kvtier.errors import ConfigError, KvtierError, UnknownBackendError
from kvtier.httpjson import answers_200
from kvtier.processes import Child, log_tail, stop_group, wait_ready

VLLM_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


class StackError(KvtierError):
    """A configuration could not be started (the message ends with its log's tail)."""


@dataclass(frozen=True)
class StackEnv:
    model: str
    served_name: str
    engine_args: tuple[str, ...]
    """vLLM flags every configuration gets (dtype, lengths, device blocks, ...)."""
    workdir: Path
    arena_bytes: int = 1 << 30
    disk_bytes: int = 4 << 30
    lmcache_l1_gb: float = 1.0
    chunk_tokens: int = 256
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable


@dataclass(frozen=True)
class ProcSpec:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None
    """The only CPUs it may run on (None: any)."""


@dataclass
class StartedConfig:
    url: str
    procs: list[Child]
    stop_timeout_s: float = 60.0
    metrics_urls: list[str] = field(default_factory=list)
    """The Prometheus pages a run reads, summed (:func:`kvtier.bench.prom.scrape_all`): a
    fleet's instances, and ``kvtier route``'s own for its decisions; empty: ``url``'s."""

    @property
    def metrics_url(self) -> str:
        """The pages, comma-separated (``bench multiround --metrics-url``)."""
        return ",".join(self.metrics_urls) or f"{self.url}/metrics"

    def alive(self) -> bool:
        return all(p.running for p in self.procs)

    def stop(self) -> None:
        # the whole group, even when its leader has exited: vLLM's EngineCore outlives a
        # crashed API server, and would go on using the cores the next stack is measured on
        for proc in reversed(self.procs):
            stop_group(proc.popen, self.stop_timeout_s)

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(f"--- {p.name} ({p.log}):\n{p.tail(lines)}" for p in self.procs)


@dataclass(frozen=True)
class StackSpec:
    name: str
    description: str
    start: Callable[[StackEnv], StartedConfig]


STACKS: dict[str, StackSpec] = {}


def register_stack(name: str, description: str, start: Callable[[StackEnv], StartedConfig]) -> None:
    if name in STACKS:
        raise ConfigError(f"stack {name!r} is registered twice")
    STACKS[name] = StackSpec(name, description, start)


def get_stack(name: str) -> StackSpec:
    if name not in STACKS:
        raise UnknownBackendError(f"unknown configuration {name!r}; known: "
                                  f"{', '.join(STACKS)}")
    return STACKS[name]


# ------------------------------------------------------------------ processes


def free_port() -> int:
    return ports.free_port()


def http_ready(url: str) -> Callable[[], bool]:
    return answers_200(url)


def tcp_ready(port: int) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return True
        except OSError:
            return False
    return ready


def engine(name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
           cpus: frozenset[int] | None = None) -> ProcSpec:
    """An OpenAI-compatible server on ``port``, ready when it lists its models."""
    return ProcSpec(name, argv, http_ready(f"http://127.0.0.1:{port}/v1/models"), env or {},
                    cpus)


def launch(env: StackEnv, specs: Sequence[ProcSpec], port: int) -> StartedConfig:
    """Start ``specs`` in order, each once the previous one is ready."""
    env.workdir.mkdir(parents=True, exist_ok=True)
    stack = StartedConfig(f"http://127.0.0.1:{port}", [], env.stop_timeout_s)
    try:
        for spec in specs:
            proc = Child.start(spec.name, spec.argv, env.workdir / f"{spec.name}.log",
                               env={**os.environ, **env.env, **spec.env}, cpus=spec.cpus)
            stack.procs.append(proc)
            _wait(spec, proc, env.ready_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait(spec: ProcSpec, proc: Child, timeout_s: float) -> None:
    if wait_ready(spec.ready, timeout_s=timeout_s, alive=lambda: proc.running):
        return
    rc = proc.returncode()
    why = (f"exited with status {rc} before it was ready" if rc is not None
           else f"was not ready after {timeout_s:.0f} s")
    raise StackError(f"{spec.name} {why}: {_cause(proc.log)}\n{proc.tail(25)}")


_CAUSE = re.compile(r"\b(?:[A-Z][A-Za-z]*Error|Exception)\b: .*")


def _cause(path: Path) -> str:
    """The log's first error line (the root cause, before the tracebacks it sets off)."""
    for line in log_tail(path, lines=1 << 20, max_bytes=200_000).splitlines():
        match = _CAUSE.search(line)
        if match and "ulimit" not in line:
            return match.group()[:300]
    return "(no error line in its log)"


# ------------------------------------------------------------------ configurations


def _vllm(env: StackEnv, port: int, python: str | None = None,
          transfer: Mapping[str, object] | None = None) -> list[str]:
    argv = [python or env.python, *VLLM_SERVER, "--model", env.model, "--served-model-name",
            env.served_name, "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", *env.engine_args]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv


def _kvtier(env: StackEnv, port: int, disk: bool) -> list[str]:
    argv = [env.python, "-m", "kvtier", "serve", "--model", env.model, "--port", str(port),
            "--host", "127.0.0.1", "--served-model-name", env.served_name,
            "--arena-size", str(env.arena_bytes), "--chunk-tokens", str(env.chunk_tokens),
            "--socket-path", str(env.workdir / "kvtier.sock"), "--enable-prefix-caching",
            "--log-file", "-"]  # vLLM's output into this stack's log, as for the others
    if disk:
        argv += ["--disk-path", str(env.workdir / "disk"), "--disk-size", str(env.disk_bytes)]
    else:
        argv += ["--no-disk"]
    return [*argv, *env.engine_args]


def _start_device(env: StackEnv) -> StartedConfig:
    port = free_port()
    return launch(env, [engine("vllm", _vllm(env, port), port)], port)


def _start_arena(env: StackEnv) -> StartedConfig:
    port = free_port()
    return launch(env, [engine("kvtier-serve", _kvtier(env, port, disk=False), port)], port)


def _start_arena_disk(env: StackEnv) -> StartedConfig:
    port = free_port()
    return launch(env, [engine("kvtier-serve", _kvtier(env, port, disk=True), port)], port)


def _start_noop(env: StackEnv) -> StartedConfig:
    port = free_port()
    transfer = {"kv_connector": "NoopConnector", "kv_connector_module_path": "kvtier.vllm.noop",
                "kv_role": "kv_both"}
    return launch(env, [engine("vllm-noop", _vllm(env, port, transfer=transfer), port)], port)


def _start_example(env: StackEnv) -> StartedConfig:
    port = free_port()
    transfer = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path":
                                              str(env.workdir / "example")}}
    return launch(env, [engine("vllm-example", _vllm(env, port, transfer=transfer), port)],
                  port)


def _start_lmcache(env: StackEnv) -> StartedConfig:
    from kvtier.bench.peers import ensure_lmcache

    python = str(ensure_lmcache(log_file=env.workdir.parent / "lmcache-install.log"))
    port, mp_port = ports.free_ports(2)  # distinct: both are held while they are picked
    server = ProcSpec("lmcache-server", [
        python, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
        "--port", str(mp_port), "--l1-size-gb", f"{env.lmcache_l1_gb:g}",
        "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
        "--chunk-size", str(env.chunk_tokens)], tcp_ready(mp_port))
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": mp_port}}
    vllm = engine("vllm-lmcache", _vllm(env, port, python=python, transfer=transfer), port)
    return launch(env, [server, vllm], port)


def _start_arena_shared(env: StackEnv) -> StartedConfig:
    """One instance whose only lower tier is a shared fs tier (as a node of a fleet would)."""
    port = free_port()
    config = env.workdir / "server.yaml"
    env.workdir.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({
        "socket_path": str(env.workdir / "kvtier.sock"),
        "arena": {"size_bytes": env.arena_bytes},
        "tiers": [{"type": "fs", "name": "shared", "capacity_bytes": env.disk_bytes,
                   "options": {"path": str(env.workdir / "shared")}}]}))
    argv = _kvtier(env, port, disk=False)
    argv[argv.index("--no-disk")] = "--server-config"
    argv.insert(argv.index("--server-config") + 1, str(config))
    return launch(env, [engine("kvtier-serve", argv, port)], port)


SHARED_KINDS = ("fs", "s3", "none")


def _two_instances(router: str, policy: str, shared: str = "fs",
                   router_args: tuple[str, ...] = ()) -> Callable[[StackEnv], StartedConfig]:
    return kvtier_fleet(2, router, policy, shared, router_args)


def kvtier_fleet(n: int, router: str, policy: str, shared: str = "fs",
                 router_args: tuple[str, ...] = ()) -> Callable[[StackEnv], StartedConfig]:
    """``kvtier serve --instances n`` (one core each) behind ``router`` (given
    ``router_args`` too), with one shared tier: ``fs`` (a folder of the run), ``s3`` (a
    SeaweedFS the stack starts in its run folder: a slow shared tier) or ``none`` (each
    instance has only its own arena). Instance i's node server (its ``/metrics``) is on the
    router's port + 101 + i."""
    if shared not in SHARED_KINDS:
        raise ValueError(f"shared: expected one of {SHARED_KINDS}, got {shared!r}")

    def start(env: StackEnv) -> StartedConfig:
        # the router on P (vllm-router's metrics on P+100), the instances on P+1+i, their
        # node servers on P+101+i, kv_aware's relays of their KV events on P+201+i
        port = ports.free_base((0, 100, *(k + i for k in (1, 101, 201) for i in range(n))))
        extra: list[str] = []
        if router == "vllm-router":  # the benchmark installs its peer; kvtier serve never does
            from kvtier.bench.peers import ensure_vllm_router

            installed = ensure_vllm_router(log_file=env.workdir.parent / "vllm-router-install.log")
            extra = ["--vllm-router", str(installed)]
        # "none", not nothing: without --shared a stack shares its default folder, which
        # outlives the run
        tier = {"fs": ["--shared", str(env.workdir / "shared")], "s3": ["--shared-local", "s3"],
                "none": ["--shared", "none"]}[shared]
        size = ["--shared-size", str(env.disk_bytes)] if shared != "none" else []
        argv = [env.python, "-m", "kvtier", "serve", "--instances", str(n), "--model", env.model,
                "--port", str(port), "--router", router, "--router-policy", policy, *extra,
                *(f"--router-arg={a}" for a in router_args),
                *tier, *size,
                "--arena-size", str(env.arena_bytes), "--run-dir", str(env.workdir / "stack"),
                "--served-model-name", env.served_name, "--chunk-tokens",
                str(env.chunk_tokens), "--enable-prefix-caching", *env.engine_args]
        stack = launch(env, [engine(f"stack-{router}-{policy}", argv, port)], port)
        stack.metrics_urls = fleet_metrics(port, n, router)
        return stack
    return start


def plain_fleet_specs(env: StackEnv, n: int, router: str, policy: str, port: int,
                      vllm_router: Path | None = None) -> list[ProcSpec]:
    """``n`` plain vLLM instances (no connector: the ``device`` configuration's command) on
    ``port+1`` .. ``port+n``, each bound to a core of its own on the CPU build as ``kvtier
    serve --instances`` binds its instances (:func:`kvtier.launch.plan.instance_binding`), then
    ``router`` (``kvtier`` or ``vllm-router``, :func:`kvtier.launch.front.router_argv`) with
    ``policy`` on ``port``."""
    from kvtier.launch.front import router_argv
    from kvtier.launch.plan import instance_binding

    specs = []
    for i in range(n):
        own = port + 1 + i
        specs.append(engine(f"vllm-{i}", _vllm(env, own), own, *instance_binding(i)))
    backends = instance_urls(port, n)
    argv = router_argv(router, policy, "127.0.0.1", port, backends, [], vllm_router)
    if argv is None:
        raise ConfigError(f"a plain fleet needs a router; got {router!r}")
    return [*specs, engine(f"router-{router}", argv, port)]


def _plain_fleet(n: int, router: str, policy: str) -> Callable[[StackEnv], StartedConfig]:
    """The fleet without kvtier: what the stack is measured against."""
    def start(env: StackEnv) -> StartedConfig:
        binary = None
        if router == "vllm-router":  # the benchmark installs its peer
            from kvtier.bench.peers import ensure_vllm_router

            binary = ensure_vllm_router(log_file=env.workdir.parent / "vllm-router-install.log")
        port = ports.free_base((*range(n + 1), 100))  # vllm-router's metrics on P+100
        stack = launch(env, plain_fleet_specs(env, n, router, policy, port, binary), port)
        stack.metrics_urls = fleet_metrics(port, n, router)
        return stack
    return start


def instance_urls(port: int, n: int) -> list[str]:
    """The ``n`` instances of a fleet whose router is on ``port``: on the ports after it."""
    return [f"http://127.0.0.1:{port + 1 + i}" for i in range(n)]


def fleet_metrics(port: int, n: int, router: str) -> list[str]:
    """The pages of a fleet whose router is on ``port``: every instance's (vLLM's counters,
    summed), and ``kvtier route``'s (its decisions). vllm-router's page on ``port`` is left
    out: it passes on an instance's."""
    routers = [f"http://127.0.0.1:{port}"] if router == "kvtier" else []
    return [f"{url}/metrics" for url in instance_urls(port, n) + routers]


register_stack("device", "plain vLLM, prefix caching on (the device cache only)", _start_device)
register_stack("device+noop", "plain vLLM with a connector that does nothing "
               "(kvtier.vllm.noop): what configuring any connector changes in vLLM",
               _start_noop)
register_stack("arena", "kvtier serve: device + host-RAM arena", _start_arena)
register_stack("arena+disk", "kvtier serve: device + arena + disk tier", _start_arena_disk)
register_stack("arena+shared", "kvtier serve: device + arena + a shared fs tier",
               _start_arena_shared)
_SETUPS = (
    ("2x", "fs", "two instances (a core each, one shared fs tier) behind "),
    ("2x-noshare", "none", "two instances (a core each), each with only its own arena (no "
     "shared tier: routing is the only way to reuse) behind "),
    ("2x-s3", "s3", "two instances (a core each) sharing a slow tier, S3 on a SeaweedFS the "
     "stack starts (same cores), behind "))
_FRONTS: tuple[tuple[str, str, str, tuple[str, ...], str], ...] = (
    ("roundrobin", "kvtier", "roundrobin", (), "kvtier route, round robin"),
    ("cache", "kvtier", "cache", (), "kvtier route, cache-aware"),
    ("cache-w1", "kvtier", "cache", ("--decode-weight=1",), "kvtier route, cache-aware, "
     "with the measured crowding of decoding streams counted (--decode-weight 1)"),
    ("cache-w0", "kvtier", "cache", ("--decode-weight=0",), "kvtier route, cache-aware, "
     "prefill queues only: decoding streams not counted (--decode-weight 0)"),
    ("cache-ask", "kvtier", "cache", ("--lookup-memory-s=0",), "kvtier route, cache-aware, "
     "asking the node servers on every decision (--lookup-memory-s 0: no memory of answers)"),
    ("vllm-router", "vllm-router", "cache_aware", (), "vLLM's own router (cache_aware)"),
    ("vllm-router-rr", "vllm-router", "round_robin", (), "vLLM's own router (round_robin)"),
    ("vllm-router-kv", "vllm-router", "kv_aware", (), "vLLM's own router (kv_aware, on the "
     "instances' KV events, relayed by the stack)"))
for _prefix, _shared, _setup in _SETUPS:
    for _suffix, _router, _policy, _args, _front in _FRONTS:
        register_stack(f"{_prefix}+{_suffix}", _setup + _front,
                       _two_instances(_router, _policy, shared=_shared, router_args=_args))
register_stack("1x-noshare+roundrobin", "one instance (a core), only its own arena (no shared "
               "tier), behind kvtier route, round robin",
               kvtier_fleet(1, "kvtier", "roundrobin", shared="none"))
register_stack("2x-plain+vllm-router", "two plain vLLM instances (a core each, no kvtier, no "
               "shared tier) behind vLLM's own router, round robin: the plain fleet",
               _plain_fleet(2, "vllm-router", "round_robin"))
register_stack("2x-plain+kvtier-rr", "two plain vLLM instances (a core each, no kvtier, no "
               "shared tier) behind kvtier route, round robin: the plain fleet",
               _plain_fleet(2, "kvtier", "roundrobin"))
register_stack("example", "vLLM's ExampleConnector (KV files in a folder)", _start_example)
register_stack("lmcache", "LMCache multi-process server + LMCacheMPConnector (own venv)",
               _start_lmcache)
