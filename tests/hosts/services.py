"""What runs on the hosts of a test: the shared tier's services and node servers, each in its
host's namespace, bound to the host's address (tests only)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hosts.netns import Host, log_tail, wait_for
from kvtier.client import KvtierClient
from kvtier.errors import ClientError
from kvtier.services import RedisServer, SeaweedFS
from kvtier.services.base import Service

NODE_PORT = 9400
"""The node HTTP API's port on every host (each host has all its ports to itself)."""
SHARING = {"journal_interval_s": 0.1, "poll_s": 0.2, "sweep_interval_s": 600}
_arenas = itertools.count()


class _InHost(Service):
    """A service whose child runs in ``net_host`` and whose probe runs from there."""

    net_host: Host

    def _command(self) -> list[str]:
        return self.net_host.argv(super()._command())

    def _answers(self) -> bool:
        return self.net_host.call(super()._answers, timeout_s=10.0)


class HostSeaweedFS(_InHost, SeaweedFS):
    def __init__(self, host: Host, **kw: Any) -> None:
        self.net_host = host
        super().__init__(host=host.address, **kw)


class HostRedis(_InHost, RedisServer):
    def __init__(self, host: Host, **kw: Any) -> None:
        self.net_host = host
        super().__init__(host=host.address, **kw)


def make_bucket(host: Host, weed: SeaweedFS, name: str) -> None:
    """Create bucket ``name`` on ``weed``, asked from ``host``."""
    import boto3

    def create() -> None:
        s3 = boto3.client("s3", endpoint_url=weed.endpoint, **weed.credentials.boto3_kwargs())
        s3.create_bucket(Bucket=name)
    host.call(create)


def key_file(folder: Path, weed: SeaweedFS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "s3.keys"
    path.write_text(f"AWS_ACCESS_KEY_ID={weed.credentials.access_key}\n"
                    f"AWS_SECRET_ACCESS_KEY={weed.credentials.secret_key}\n")
    path.chmod(0o600)
    return path


@dataclass
class NodeServer:
    """``kvtier server`` on ``host``: its socket under ``root``, its HTTP API on the host's
    address, the node token and the cluster secret in its environment."""

    host: Host
    root: Path
    tiers: list[dict[str, Any]]
    token: str
    secret: str
    slots: int = 16
    slot_bytes: int = 8192
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def socket_path(self) -> str:
        return str(self.root / "kvtier.sock")

    @property
    def url(self) -> str:
        return self.host.url(NODE_PORT)

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def config(self) -> dict[str, Any]:
        return {
            "socket_path": self.socket_path, "log_format": "text",
            "arena": {"size_bytes": self.slots * self.slot_bytes, "slot_bytes": self.slot_bytes,
                      "name": f"kvh-{os.getpid()}-{next(_arenas)}", "free_target": 0.0},
            "tiers": self.tiers, "metrics_host": self.host.address, "metrics_port": NODE_PORT,
        }

    def start(self) -> NodeServer:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "server.yaml"
        path.write_text(yaml.safe_dump(self.config()))
        env = {**os.environ, "KVTIER_NODE_TOKEN": self.token,
               "KVTIER_SHARED_SECRET": self.secret}
        self.popen = self.host.spawn([sys.executable, "-m", "kvtier", "server", "--config",
                                      str(path)], log=self.log, env=env)
        wait_for(self._connects, timeout_s=30, what=f"node server on {self.host}",
                 popen=self.popen, log=self.log)
        return self

    def _connects(self) -> bool:
        with contextlib.suppress(ClientError, OSError), KvtierClient(self.socket_path) as c:
            c.connect()
            return True
        return False

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)

    def tail(self) -> str:
        return log_tail(self.log)


def http(url: str, body: Any = None, *, token: str | None = None,
         wait_s: float = 5.0) -> tuple[int, Any]:
    """One request (JSON in and out); (status, parsed body or text)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers,
                                     method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=wait_s) as answer:
            status, raw = answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def secret(label: str) -> str:
    return hashlib.sha256(f"{label}-{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()
