"""SeaweedFS on loopback: one ``weed mini`` (master, volume, filer, S3 gateway) per instance.

Every port is pinned (HTTP and gRPC, ten in all) so several instances run side by side; it binds
and advertises one address, 127.0.0.1 unless given another (``host``: a host's own address when
it serves other hosts; never all interfaces); telemetry, WebDAV, the admin UI and the
Iceberg/Lance catalogs are off; the S3 credentials are in its environment, never on its command
line. A fresh data folder per instance (``weed mini`` re-reads ``mini.options`` from it), kept
across ``stop`` / ``start`` so an outage test finds its objects again.

    with SeaweedFS() as weed:
        s3 = boto3.client("s3", endpoint_url=weed.endpoint, **weed.credentials.boto3_kwargs())
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path

from kvtier.httpjson import http_status
from kvtier.ports import free_ports
from kvtier.services.base import Service
from kvtier.services.binaries import WEED, find_binary
from kvtier.services.lifetime import remove_weed_sockets, write_ports
from kvtier.services.probes import HOST, check_host


@dataclass(frozen=True)
class SeaweedPorts:
    s3: int
    s3_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    admin: int
    admin_grpc: int

    @classmethod
    def pick(cls) -> SeaweedPorts:
        return cls(*free_ports(len(fields(cls))))

    def flags(self) -> list[str]:
        return [
            f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
            f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
            f"-admin.port={self.admin}", f"-admin.port.grpc={self.admin_grpc}",
        ]


@dataclass(frozen=True)
class S3Credentials:
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def boto3_kwargs(self) -> dict[str, str]:
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key,
                "region_name": self.region}

    def __repr__(self) -> str:  # never print the secret
        return f"S3Credentials(access_key={self.access_key!r}, region={self.region!r})"


class SeaweedFS(Service):
    """``weed mini`` with an S3 gateway. ``endpoint`` for S3 clients, ``filer_address`` for
    ``weed mount`` (:class:`kvtier.services.SeaweedMount`)."""

    kind = "seaweedfs"

    def __init__(self, *, ports: SeaweedPorts | None = None,
                 credentials: S3Credentials | None = None, workdir: Path | None = None,
                 extra_args: Sequence[str] = (), host: str = HOST,
                 start_timeout_s: float = 60.0,
                 stop_timeout_s: float = 15.0, die_with_parent: bool = True) -> None:
        self.host = check_host(host)  # before a working folder is made
        super().__init__(workdir=workdir, start_timeout_s=start_timeout_s,
                         stop_timeout_s=stop_timeout_s, die_with_parent=die_with_parent)
        self._fixed_ports = ports is not None
        self.ports = ports or SeaweedPorts.pick()
        write_ports(self.workdir, list(astuple(self.ports)))
        self.credentials = credentials or S3Credentials(
            access_key="kvtier", secret_key=secrets.token_hex(16))
        self.extra_args = list(extra_args)
        for sub in ("data", "logs", "tmp"):
            (self.workdir / sub).mkdir(exist_ok=True)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports.s3}"

    @property
    def filer_address(self) -> str:
        """``host:httpPort.grpcPort``, the form ``weed mount -filer=`` needs for a pinned gRPC
        port (``host:port`` alone would mean gRPC on port + 10000)."""
        return f"{self.host}:{self.ports.filer}.{self.ports.filer_grpc}"

    @property
    def filer_url(self) -> str:
        return f"http://{self.host}:{self.ports.filer}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    def client_env(self) -> dict[str, str]:
        """Environment for an S3 client of this server (boto3 reads every one of these)."""
        return {"AWS_ACCESS_KEY_ID": self.credentials.access_key,
                "AWS_SECRET_ACCESS_KEY": self.credentials.secret_key,
                "AWS_DEFAULT_REGION": self.credentials.region,
                "AWS_ENDPOINT_URL": self.endpoint}

    def _command(self) -> list[str]:
        w = self.workdir
        return [
            find_binary(WEED), f"-logdir={w / 'logs'}", "mini", f"-dir={self.data_dir}",
            f"-ip={self.host}", f"-ip.bind={self.host}", "-master.telemetry=false", "-webdav=false",
            "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={w / 'filer.sock'}", f"-s3.localSocket={w / 's3.sock'}",
            *self.ports.flags(), *self.extra_args,
        ]

    def _environment(self) -> Mapping[str, str]:
        return {**os.environ, "TMPDIR": str(self.workdir / "tmp"),
                "AWS_ACCESS_KEY_ID": self.credentials.access_key,
                "AWS_SECRET_ACCESS_KEY": self.credentials.secret_key}

    def _answers(self) -> bool:
        # S3 answers an anonymous request (403 with credentials enforced); the filer serves
        # its root; both come up last in weed mini.
        return (http_status(f"http://{self.host}:{self.ports.s3}/", timeout_s=1.0) is not None
                and http_status(f"http://{self.host}:{self.ports.filer}/", method="HEAD",
                                timeout_s=1.0) is not None)

    def _where(self) -> str:
        return f"S3 {self.endpoint}, filer {self.filer_address}, data {self.data_dir}"

    def _new_ports(self) -> bool:
        if self._fixed_ports:
            return False
        self.ports = SeaweedPorts.pick()
        write_ports(self.workdir, list(astuple(self.ports)))
        # mini.options in the data folder remembers the old ports; it never served, so go.
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir()
        return True

    def _after_stop(self) -> None:
        remove_weed_sockets(self.workdir)
