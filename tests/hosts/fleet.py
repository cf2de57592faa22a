"""A kvtier fleet on hosts of its own (tests only): instance hosts each running ``kvtier serve``
(vLLM CPU build, the connector, its node server on the host's address), a shared-tier host
(SeaweedFS S3), a router host (``kvtier route --strategy cache``), a client host, and a plain
vLLM without kvtier for the baseline tokens.

Each vLLM is bound wholly to one core (``VLLM_CPU_OMP_THREADS_BIND`` and the CPU affinity of
all its processes), as ``kvtier serve --instances`` binds its instances.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hosts.netns import Host, Network, wait_for
from hosts.services import NODE_PORT, SHARING, HostSeaweedFS, http, key_file, make_bucket
from kvtier.launch.front import KvEventSources, router_argv
from kvtier.launch.kv_events import instance_events_config
from kvtier.launch.plan import allowed_cpus

API_PORT = 8000
"""vLLM's and the router's port on their hosts."""
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "10240", "--num-gpu-blocks-override",
               "96"]
MODEL = "kvtier-demo"
READY_S = 600.0
KV_EVENTS_PORT = 5557
"""Where each instance publishes its KV events: ``tcp://*:PORT``, every address of its own
host, so a router on another host subscribes to the instance's address, no relay."""
DISCOVERY_S = 2.0
"""The router re-reads its backends file this often."""


@dataclass
class Instance:
    """``kvtier serve`` on one host, bound to one core."""

    host: Host
    cpu: int
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return self.host.url(API_PORT)

    @property
    def node(self) -> str:
        return self.host.url(NODE_PORT)


def server_yaml(folder: Path, host: Host, tier: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "server.yaml"
    path.write_text(yaml.safe_dump({
        "socket_path": str(folder / "kvtier.sock"), "log_format": "text",
        "arena": {"size_bytes": 256 << 20, "name": f"kvh-{os.getpid()}-{host.name[-2:]}"},
        "tiers": [tier], "metrics_host": host.address, "metrics_port": NODE_PORT}))
    return path


def binding(cpu: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpu)}


class Fleet:
    """Everything of the module's tests, started once; ``close`` through the network."""

    def __init__(self, network: Network, root: Path, token: str, cluster: str) -> None:
        self.network = network
        self.root = root
        self.token = token
        self.env = {**os.environ, "KVTIER_NODE_TOKEN": token, "KVTIER_SHARED_SECRET": cluster}
        self.shared = network.add_host("shared")
        self.router_host = network.add_host("router")
        self.client = network.add_host("client")
        self.instances: list[Instance] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.baseline: subprocess.Popen[bytes] | None = None
        self.prompts: dict[str, str | list[int]] = {}
        self.expected: dict[str, str] = {}
        """The baseline's text for each prompt."""
        self.weed = HostSeaweedFS(self.shared).start()
        make_bucket(self.client, self.weed, "kvtier")
        self.tier = {"type": "s3", "name": "shared", "capacity_bytes": 1 << 30,
                     "io_threads": 4,
                     "options": {"bucket": "kvtier", "endpoint_url": self.weed.endpoint,
                                 "tls": False,
                                 "credentials": f"file:{key_file(root / 'keys', self.weed)}",
                                 **SHARING}}

    @property
    def router_url(self) -> str:
        return self.router_host.url(API_PORT)

    def cpu(self, i: int) -> int:
        cpus = allowed_cpus()
        return cpus[i % len(cpus)]

    def add_instance(self) -> Instance:
        """Start ``kvtier serve`` on a new host (not waiting for it)."""
        i = len(self.instances)
        host = self.network.add_host(f"i{i + 1}")
        folder = self.root / host.name
        config = server_yaml(folder, host, self.tier)
        instance = Instance(host, self.cpu(i), folder / "serve.log")
        argv = [sys.executable, "-m", "kvtier", "serve", "--server-config", str(config),
                "--log-file", "-", "--host", host.address, "--port", str(API_PORT),
                "--kv-events-config", instance_events_config(f"tcp://*:{KV_EVENTS_PORT}"),
                *ENGINE_ARGS]
        instance.popen = host.spawn(argv, log=instance.log, env={**self.env,
                                    **binding(instance.cpu)}, cpus=[instance.cpu])
        self.instances.append(instance)
        return instance

    def start_baseline(self, model: str) -> None:
        """vLLM with the same flags as ``kvtier serve`` gives it, without the connector."""
        from kvtier.cli import build_parser
        from kvtier.launch.serve import build_plan

        args = build_parser().parse_args(["serve", "--no-disk", "--dry-run", "--host",
                                          self.client.address, "--port", str(API_PORT),
                                          *ENGINE_ARGS])
        cmd = build_plan(args).cmd
        at = cmd.index("--kv-transfer-config")
        del cmd[at:at + 2]
        assert "KvtierConnector" not in " ".join(cmd), cmd
        cpu = self.cpu(1)
        self.baseline = self.client.spawn(cmd, log=self.root / "baseline.log",
                                          env={**os.environ, **binding(cpu)}, cpus=[cpu])

    def stop_baseline(self) -> None:
        if self.baseline is not None and self.baseline.poll() is None:
            os.killpg(self.baseline.pid, 15)
            self.baseline.wait(timeout=60)

    def wait_serving(self, url: str, popen: subprocess.Popen[bytes] | None, log: Path) -> None:
        def up() -> bool:
            try:
                status, doc = self.client.call(http, url + "/v1/models", timeout_s=10.0,
                                               wait_s=5.0)
            except OSError:
                return False
            return status == 200 and bool(doc.get("data"))
        wait_for(up, timeout_s=READY_S, every_s=1.0, what=f"vLLM at {url}", popen=popen,
                 log=log)

    @property
    def backends_file(self) -> Path:
        return self.root / "backends.txt"

    def list_backends(self) -> None:
        """Write the router's backends file (atomically: a new file renamed over the old)."""
        new = self.backends_file.with_suffix(".new")
        new.write_text("".join(f"{i.url}\n" for i in self.instances))
        new.replace(self.backends_file)

    def start_router(self, *extra: str) -> None:
        """``kvtier route --strategy cache`` following the backends file; each backend's node
        server at NODE_PORT on its address."""
        self.list_backends()
        argv = [sys.executable, "-m", "kvtier", "route", "--backends-file",
                str(self.backends_file), "--kvtier-server-port", str(NODE_PORT),
                "--discovery-interval-s", str(DISCOVERY_S), "--strategy", "cache", "--host",
                self.router_host.address, "--port", str(API_PORT), "--health-interval-s",
                "1", *extra]
        log = self.root / "router.log"
        self.router = self.router_host.spawn(argv, log=log, env=self.env)
        self.wait_serving(self.router_url, self.router, log)

    def start_dns_router(self, name: str) -> str:
        """``kvtier route --backends-dns http://NAME:PORT`` on a host of its own, whose
        resolver answers ``name`` with every instance's address (its hosts file, which ``ip
        netns exec`` puts over /etc/hosts: the system resolver, as a headless Service's A
        records would be); its URL."""
        host = self.network.add_host("dns")
        host.hosts_file({name: [i.host.address for i in self.instances]})
        argv = [sys.executable, "-m", "kvtier", "route", "--backends-dns",
                f"http://{name}:{API_PORT}", "--kvtier-server-port", str(NODE_PORT),
                "--discovery-interval-s", str(DISCOVERY_S), "--strategy", "cache", "--host",
                host.address, "--port", str(API_PORT), "--health-interval-s", "1"]
        log = self.root / "dns-router.log"
        popen = host.spawn(argv, log=log, env=self.env)
        self.wait_serving(host.url(API_PORT), popen, log)
        return host.url(API_PORT)

    def start_vllm_router(self, binary: str) -> str:
        """vllm-router ``kv_aware`` on a host of its own, subscribed to each instance's KV
        events on the instance's address; its URL."""
        host = self.network.add_host("vrouter")
        sources = KvEventSources(
            tuple(f"tcp://{i.host.address}:{KV_EVENTS_PORT}" for i in self.instances),
            128, MODEL)  # the CPU build's default block size
        argv = router_argv("vllm-router", "kv_aware", host.address, API_PORT,
                           [i.url for i in self.instances], [], Path(binary),
                           kv_events=sources,
                           extra=["--log-level", "debug"])  # its prefix decisions
        assert argv is not None
        log = self.root / "vllm-router.log"
        popen = host.spawn(argv, log=log, env=dict(os.environ))
        url = host.url(API_PORT)
        self.wait_serving(url, popen, log)
        return url

    def complete(self, url: str, prompt: str | list[int], max_tokens: int = 8) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0}
        status, doc = self.client.call(http, url + "/v1/completions", body, timeout_s=300.0,
                                       wait_s=240.0)
        assert status == 200, (status, doc)
        return dict(doc)

    def close(self) -> None:
        try:
            self.weed.close()
        finally:
            self.network.close()
            for arena in Path("/dev/shm").glob(f"kvh-{os.getpid()}-*"):
                arena.unlink(missing_ok=True)  # a killed host's node server leaves its arena
