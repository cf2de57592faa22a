"""A Redis Cluster on loopback: N primaries with a replica each, one redis-server per node.

Each node is a :class:`RedisServer` with ``cluster-enabled yes`` and a bus port of its own
(``cluster-port``, so no port is derived by adding 10000). ``redis-cli --cluster create`` joins
them and hands out the 16384 slots; :meth:`RedisCluster.start` returns once every node reports
``cluster_state:ok`` and agrees on the primaries. A failed start stops every node it started.
Nothing is saved: a node stopped and started again comes back empty, as a replica of nothing.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from kvtier.errors import ServiceError, ServiceStartError
from kvtier.ports import free_ports
from kvtier.services.binaries import REDIS_CLI, find_binary
from kvtier.services.lifetime import make_workdir, remove_workdir
from kvtier.services.probes import HOST
from kvtier.services.redis_server import RedisServer

CLI_TIMEOUT_S = 30.0


class RedisCluster:
    """``primaries`` primaries and ``primaries * replicas`` replicas on 127.0.0.1; ``url`` is
    one node's (a client learns the rest from it), ``nodes`` all of them."""

    def __init__(self, *, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000,
                 maxmemory: int | None = None, maxmemory_policy: str | None = None,
                 start_timeout_s: float = 30.0) -> None:
        if primaries < 3:
            raise ServiceError("a Redis Cluster needs at least 3 primaries")
        if not 0 <= replicas <= 3 or node_timeout_ms < 100:
            raise ServiceError("replicas must be in [0, 3] and node_timeout_ms >= 100")
        self.workdir = make_workdir("redis-cluster")
        self.start_timeout_s = start_timeout_s
        self.replicas = replicas
        count = primaries * (1 + replicas)
        ports = free_ports(2 * count)
        self.nodes = [
            RedisServer(port=ports[2 * i], workdir=self.workdir / f"node{i}",
                        maxmemory=maxmemory, maxmemory_policy=maxmemory_policy,
                        extra_config={"cluster-enabled": "yes",
                                      "cluster-port": str(ports[2 * i + 1]),
                                      "cluster-config-file": "nodes.conf",
                                      "cluster-node-timeout": str(node_timeout_ms),
                                      "cluster-require-full-coverage": "yes",
                                      "cluster-replica-validity-factor": "0"})
            for i in range(count)]
        self.primaries = primaries
        self._closed = False

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> Self:
        try:
            for node in self.nodes:
                node.start()
            self._create()
            self.wait_ok(self.start_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        cli = find_binary(REDIS_CLI)
        argv = [cli, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                                  check=False, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise ServiceStartError(f"redis-cli --cluster create took over {CLI_TIMEOUT_S:g} s"
                                    ) from exc
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            raise ServiceStartError(f"redis-cli --cluster create failed ({done.returncode}): "
                                    f"{(done.stdout + done.stderr)[-2000:]}")

    def info(self, node: RedisServer, section: str = "info") -> dict[str, str]:
        """``CLUSTER INFO`` of one node as a dict (empty if it does not answer)."""
        text = cli(node.port, "cluster", section)
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def wait_ok(self, timeout_s: float) -> None:
        """Until every running node says ``cluster_state:ok`` and counts the same primaries
        with slots; ServiceStartError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [self.info(n) for n in self.nodes if n.running]
            if states and all(s.get("cluster_state") == "ok" and
                              s.get("cluster_size") == str(self.primaries) for s in states):
                return
            time.sleep(0.1)
        raise ServiceStartError(f"redis cluster in {self.workdir}: not cluster_state:ok within "
                                f"{timeout_s:g} s")

    def role(self, node: RedisServer) -> str:
        """``master`` or ``slave`` (ROLE's first word; empty if it does not answer)."""
        return cli(node.port, "role").split("\n", 1)[0].strip()

    def primary_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running and self.role(n) == "master"]

    def owner_of(self, key: str) -> RedisServer:
        """The running primary that serves ``key``'s slot now."""
        slot = int(cli(self.nodes[0].port, "cluster", "keyslot", key) or -1)
        for node in self.primary_nodes():
            if _serves(node.port, slot):
                return node
        raise ServiceError(f"no running primary serves slot {slot}")

    def wait_promoted(self, dead: RedisServer, timeout_s: float) -> None:
        """Until the cluster is ok again without ``dead`` (its replica took over)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.running and n is not dead]
            states = [self.info(n) for n in live]
            if states and all(s.get("cluster_state") == "ok" for s in states) and \
                    len(self.primary_nodes()) == self.primaries:
                return
            time.sleep(0.1)
        raise ServiceError(f"no replica took over from {dead} within {timeout_s:g} s")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        errors = []
        for node in self.nodes:
            try:
                node.close()
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        remove_workdir(self.workdir)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RedisCluster {Path(self.workdir).name} {[n.port for n in self.nodes]}>"


def cli(port: int, *args: str) -> str:
    """One redis-cli command to a loopback node; its output, or '' if it does not answer."""
    try:
        done = subprocess.run([find_binary(REDIS_CLI), "-h", HOST, "-p", str(port), *args],
                              capture_output=True, text=True, timeout=5, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _serves(port: int, slot: int) -> bool:
    """Whether the node on ``port`` holds ``slot`` by its own CLUSTER NODES line."""
    mine = cli(port, "cluster", "myid")
    text = cli(port, "cluster", "nodes")
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == mine:
            for span in fields[8:]:
                low, _, high = span.partition("-")
                if low.isdigit() and int(low) <= slot <= int(high or low):
                    return True
    return False
