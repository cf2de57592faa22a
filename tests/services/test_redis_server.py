"""redis-server on loopback, driven with redis-py the way the redis tier will drive it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.errors import ConfigError, ServiceMissing, ServiceStartError
from kvtier.services import RedisServer
from kvtier.services import redis_server as redis_server_module

from .procnet import listening

pytestmark = pytest.mark.services
MiB = 1 << 20


def test_set_get_one_mib_values_and_pipelines(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    values = {f"chunk:{i}": os.urandom(MiB) for i in range(8)}
    with r.pipeline(transaction=False) as pipe:
        for key, value in values.items():
            pipe.set(key, value)
        assert pipe.execute() == [True] * len(values)
    with r.pipeline(transaction=False) as pipe:
        for key in values:
            pipe.get(key)
        assert pipe.execute() == list(values.values())


def test_exists_counts_many_keys_in_one_round_trip(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    keys = [f"k:{i:04d}" for i in range(512)]
    r.mset({k: b"1" for k in keys[:300]})
    assert r.exists(*keys) == 300
    assert r.exists(*keys[300:]) == 0


def test_auth_is_required_when_a_password_is_set(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis(password="s3cret-pw")
    assert b"s3cret-pw" not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
    # redis-py 8 retries a refused AUTH with backoff (~2-4 s) unless told not to
    no_retry = Retry(NoBackoff(), 0)
    anonymous = redis.Redis(host=server.host, port=server.port, retry=no_retry)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    wrong = redis.Redis(host=server.host, port=server.port, password="nope", retry=no_retry)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    assert redis.Redis.from_url(server.url).ping()


def test_restart_loses_the_keys_and_the_client_reconnects(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    r.set("before", b"x")
    redis_server.restart()
    assert r.get("before") is None, "no persistence: a restart empties the cache"
    assert r.set("after", b"y") and r.get("after") == b"y"


def test_a_stopped_server_refuses_and_a_paused_one_times_out(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url, socket_timeout=0.5, socket_connect_timeout=0.5,
                             retry_on_timeout=False)
    r.set("k", b"v")
    redis_server.stop()
    with pytest.raises(redis.ConnectionError):
        r.get("k")
    redis_server.start()
    redis_server.pause()
    started = time.monotonic()
    with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
        r.get("k")
    assert time.monotonic() - started < 3
    redis_server.resume()
    assert r.set("k", b"w") and r.get("k") == b"w"


def test_maxmemory_policy_evicts_instead_of_failing(make_redis: Callable[..., RedisServer]) -> None:
    server = make_redis(maxmemory=8 * MiB, maxmemory_policy="allkeys-lru")
    r = redis.Redis.from_url(server.url)
    for i in range(32):
        r.set(f"chunk:{i}", os.urandom(MiB))
    info = r.info()
    assert info["maxmemory_policy"] == "allkeys-lru"
    assert info["evicted_keys"] > 0
    assert r.dbsize() < 32 and r.exists("chunk:31") == 1
    assert info["used_memory"] <= 8 * MiB + MiB


def test_listens_on_loopback_only(redis_server: RedisServer) -> None:
    assert redis_server.pid is not None
    assert listening(redis_server.pid) == {("127.0.0.1", redis_server.port)}


def test_a_taken_port_is_replaced_before_the_first_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real = redis_server_module.free_ports
        draws = iter([[taken]])
        monkeypatch.setattr(redis_server_module, "free_ports",
                            lambda n: next(draws, None) or real(n))
        server = RedisServer()
        try:
            assert server.port == taken
            server.start()
            assert server.port != taken and redis.Redis.from_url(server.url).ping()
        finally:
            server.close()


def test_a_fixed_port_that_is_taken_fails_with_the_log() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = RedisServer(port=squatter.getsockname()[1])
        try:
            with pytest.raises(ServiceStartError, match="port is taken") as failed:
                server.start()
            assert "Address already in use" in str(failed.value)
        finally:
            server.close()


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"maxmemory_policy": "lru"}, "maxmemory_policy"),
    ({"maxmemory": 0}, "maxmemory"),
    ({"password": "has space"}, "password"),
])
def test_bad_options_name_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RedisServer(**kwargs)  # type: ignore[arg-type]


def test_a_missing_binary_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_REDIS_SERVER", "/nonexistent/redis-server")
    server = RedisServer()
    try:
        with pytest.raises(ServiceMissing, match="KVTIER_REDIS_SERVER"):
            server.start()
    finally:
        server.close()
    monkeypatch.delenv("KVTIER_REDIS_SERVER")
    monkeypatch.setenv("PATH", "/nonexistent")
    server = RedisServer()
    try:
        with pytest.raises(ServiceMissing, match="apt-get install -y redis-server"):
            server.start()
    finally:
        server.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "localhost", "224.0.0.1", ""])
def test_a_service_binds_one_address_never_a_wildcard(host: str) -> None:
    from kvtier.services import SeaweedFS

    for make in (RedisServer, SeaweedFS):
        with pytest.raises(ConfigError, match="host"):
            make(host=host)


def test_redis_beyond_loopback_needs_a_password() -> None:
    with pytest.raises(ConfigError, match=r"password: Redis on 10\.0\.0\.5 .*give a password"):
        RedisServer(host="10.0.0.5")
    server = RedisServer(host="10.0.0.5", password="s3cret-pw")  # refused only without one
    try:
        assert server.host == "10.0.0.5"
    finally:
        server.close()
    RedisServer(host="127.0.0.2").close()  # loopback: no password needed
