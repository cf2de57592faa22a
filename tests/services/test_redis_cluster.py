"""A Redis Cluster on loopback: 3 primaries and 3 replicas that agree, every process stopped by
its PID and the folder removed afterwards, also when the start fails."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from kvtier.errors import ServiceError, ServiceStartError
from kvtier.services import RedisCluster
from kvtier.services import redis_cluster as redis_cluster_module

pytestmark = pytest.mark.services


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_primaries_three_replicas_then_nothing_left(
        make_redis_cluster: Callable[..., RedisCluster]) -> None:
    cluster = make_redis_cluster()
    roles = sorted(cluster.role(n) for n in cluster.nodes)
    assert roles == ["master"] * 3 + ["slave"] * 3
    assert all(cluster.info(n)["cluster_state"] == "ok" for n in cluster.nodes)
    assert len({n.port for n in cluster.nodes}) == 6
    pids = [n.pid for n in cluster.nodes]
    assert all(pid is not None and alive(pid) for pid in pids)
    cluster.close()
    assert not any(alive(pid) for pid in pids if pid is not None)
    assert not cluster.workdir.exists()


def test_a_failed_create_stops_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = RedisCluster()
    monkeypatch.setattr(redis_cluster_module, "CLI_TIMEOUT_S", 30.0)
    monkeypatch.setattr(cluster, "replicas", 3)  # 6 nodes cannot give 3 primaries 3 each
    with pytest.raises(ServiceStartError, match="cluster create"):
        cluster.start()
    assert not any(n.running for n in cluster.nodes)
    assert not cluster.workdir.exists()


def test_fewer_than_three_primaries_is_refused() -> None:
    with pytest.raises(ServiceError, match="at least 3 primaries"):
        RedisCluster(primaries=2)
