"""Shared fixtures: stores on a private arena and disk folder, embedded servers and clients.

Every arena gets a name of its own (pid + counter) and is unlinked in teardown, so tests never
share or leak shared memory, even when they run in parallel processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import (  # noqa: F401  (fixtures: real services on loopback)
    make_redis,
    make_redis_cluster,
    make_seaweed_mount,
    make_seaweedfs,
    redis_server,
    s3_bucket,
    seaweed_mount,
    seaweedfs,
    session_seaweedfs,
)
from store_helpers import MakeServer, MakeStore, build_store, server_config

from kvtier.client import KvtierClient
from kvtier.server import EmbeddedServer, NodeServer
from kvtier.store import TieredStore
from kvtier.tiers.arena import shm_path


@pytest.fixture
def make_store() -> Iterator[MakeStore]:
    """``make_store(tmp_path, slots=6, disk_bytes=None, write_policy=..., admission=...)``."""
    stores: list[TieredStore] = []

    def make(root: Path, **kw: Any) -> TieredStore:
        store = build_store(root, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(drain_s=5)
        assert not os.path.exists(shm_path(store.arena.name)), "arena left in /dev/shm"


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[MakeServer]:
    """``make_server(slots=8, disk_bytes=None, **server_config)``: started, stopped in teardown."""
    servers: list[NodeServer] = []

    def make(**kw: Any) -> NodeServer:
        server = EmbeddedServer(server_config(tmp_path, **kw)).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(drain_s=5)
        assert not os.path.exists(shm_path(server.arena_name)), "arena left in /dev/shm"


@pytest.fixture
def server(make_server: MakeServer) -> NodeServer:
    return make_server()


@pytest.fixture
def client(server: NodeServer) -> Iterator[KvtierClient]:
    with KvtierClient(server.socket_path, name="test") as c:
        yield c
