"""Fixtures that start real services on loopback (kvtier.services); tests/conftest.py imports
them, so every test folder can use them. Mark the tests that use them ``services``.

A service that cannot run here (binary not installed, no FUSE) makes the test error out with
the install hint. Only with ``KVTIER_ALLOW_MISSING_SERVICES=1`` is it skipped instead: for a
developer machine without them; CI never sets it, so CI never silently skips a shared tier.

Session-scoped, shared by the tests of a run (start-up is the slow part):
    ``seaweedfs``         one SeaweedFS (S3 + filer); tests keep to their own bucket or folder
Function-scoped, for isolation and outage tests (stop/start/pause/kill them at will):
    ``s3_bucket``         a fresh bucket on ``seaweedfs``, emptied and removed afterwards
    ``seaweed_mount``     a FUSE mount of a fresh folder of ``seaweedfs``
    ``make_seaweedfs``    ``make_seaweedfs(**SeaweedFS kwargs)``: a SeaweedFS of the test's own
    ``make_seaweed_mount`` ``make_seaweed_mount(weed=None, folder=None, **kwargs)``
    ``redis_server``      a redis-server of the test's own (it starts in ~0.05 s)
    ``make_redis``        ``make_redis(password=..., maxmemory=..., maxmemory_policy=...)``
    ``make_redis_cluster`` ``make_redis_cluster(**RedisCluster kwargs)``: 3 primaries + 3
                          replicas by default (starts in ~3 s)
"""

from __future__ import annotations

import importlib.util
import os
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, Self, TypeVar

import pytest

from kvtier.errors import ServiceMissing
from kvtier.services import RedisCluster, RedisServer, S3Credentials, SeaweedFS, SeaweedMount

ALLOW_MISSING = "KVTIER_ALLOW_MISSING_SERVICES"


class Startable(Protocol):
    def start(self) -> Self: ...
    def close(self) -> None: ...


S = TypeVar("S", bound=Startable)


def left_out(needs: dict[str, str]) -> tuple[list[str], list[str]]:
    """(modules whose client library is missing, test files to leave out): files are left out
    only when KVTIER_ALLOW_MISSING_SERVICES=1 (a developer machine); elsewhere (CI) they fail
    to collect, with the ImportError. ``needs``: test file -> the module it imports."""
    missing = sorted({m for m in needs.values() if importlib.util.find_spec(m) is None})
    ignored = ([name for name, module in needs.items() if module in missing]
               if os.environ.get(ALLOW_MISSING) == "1" else [])
    return missing, ignored


def start_or_fail(make: Callable[[], S]) -> S:
    """Create and start a service; a missing prerequisite fails the test (or skips it where
    KVTIER_ALLOW_MISSING_SERVICES=1)."""
    try:
        service = make()
    except ServiceMissing as exc:
        _missing(exc)
    try:
        return service.start()
    except ServiceMissing as exc:
        service.close()
        _missing(exc)
    except BaseException:
        service.close()
        raise


def _missing(exc: ServiceMissing) -> NoReturn:
    if os.environ.get(ALLOW_MISSING) == "1":
        pytest.skip(f"{exc} ({ALLOW_MISSING}=1)")
    pytest.fail(f"{exc}\n(CI must provide it: `make system-deps setup`; to skip these tests "
                f"on this machine instead, set {ALLOW_MISSING}=1)", pytrace=False)


@pytest.fixture(scope="session")
def session_seaweedfs() -> Iterator[SeaweedFS]:
    weed = start_or_fail(SeaweedFS)
    yield weed
    weed.close()


@pytest.fixture
def seaweedfs(session_seaweedfs: SeaweedFS) -> SeaweedFS:
    """The session's SeaweedFS, started again (its data and ports kept) when it has exited
    since the test before: SeaweedFS 4.48's filer once panicked under the suite (a nil
    pointer in ``cleanupChunks`` while a FUSE mount wrote), and that crash must fail the
    test that met it, not every test after it."""
    weed = session_seaweedfs
    if not weed.running:
        warnings.warn(f"the session's SeaweedFS had exited (status {weed.exit_status()}); "
                      f"started again. Its log ended:\n{weed.log_tail(12)}", stacklevel=1)
        weed.start()
    return weed


@dataclass(frozen=True)
class Bucket:
    name: str
    endpoint: str
    credentials: S3Credentials

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this bucket's server (``config``: botocore Config kwargs)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint,
                            config=Config(**{"retries": {"max_attempts": 2}, **config}),
                            **self.credentials.boto3_kwargs())


@pytest.fixture
def s3_bucket(seaweedfs: SeaweedFS) -> Iterator[Bucket]:
    bucket = Bucket(f"t-{uuid.uuid4().hex[:20]}", seaweedfs.endpoint, seaweedfs.credentials)
    s3 = bucket.client()
    s3.create_bucket(Bucket=bucket.name)
    yield bucket
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket.name):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket.name, Key=obj["Key"])
    s3.delete_bucket(Bucket=bucket.name)


@pytest.fixture
def make_seaweedfs() -> Iterator[Callable[..., SeaweedFS]]:
    made: list[SeaweedFS] = []

    def make(**kwargs: Any) -> SeaweedFS:
        weed = start_or_fail(lambda: SeaweedFS(**kwargs))
        made.append(weed)
        return weed

    yield make
    for weed in reversed(made):
        weed.close()


@pytest.fixture
def make_seaweed_mount(seaweedfs: SeaweedFS) -> Iterator[Callable[..., SeaweedMount]]:
    """``make(weed=None, folder=None, **kwargs)``: mounts ``folder`` of ``weed`` (default: the
    session server and a folder new to this test, the same one for every mount it makes)."""
    made: list[SeaweedMount] = []
    own_folder = f"/t-{uuid.uuid4().hex[:20]}"

    def make(weed: SeaweedFS | None = None, folder: str | None = None,
             **kwargs: Any) -> SeaweedMount:
        server = weed or seaweedfs
        mount = start_or_fail(lambda: SeaweedMount(
            server.filer_address, filer_path=folder or own_folder, **kwargs))
        made.append(mount)
        return mount

    yield make
    for mount in reversed(made):
        mount.close()
        assert not mount.mounted, f"{mount.path} is still mounted"


@pytest.fixture
def seaweed_mount(make_seaweed_mount: Callable[..., SeaweedMount]) -> SeaweedMount:
    return make_seaweed_mount()


@pytest.fixture
def make_redis() -> Iterator[Callable[..., RedisServer]]:
    made: list[RedisServer] = []

    def make(**kwargs: Any) -> RedisServer:
        server = start_or_fail(lambda: RedisServer(**kwargs))
        made.append(server)
        return server

    yield make
    for server in reversed(made):
        server.close()


@pytest.fixture
def redis_server(make_redis: Callable[..., RedisServer]) -> RedisServer:
    return make_redis()


@pytest.fixture
def make_redis_cluster() -> Iterator[Callable[..., RedisCluster]]:
    made: list[RedisCluster] = []

    def make(**kwargs: Any) -> RedisCluster:
        cluster = start_or_fail(lambda: RedisCluster(**kwargs))
        made.append(cluster)
        return cluster

    yield make
    for cluster in reversed(made):
        cluster.close()
