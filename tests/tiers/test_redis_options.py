"""The redis tier's options and Redis's eviction settings, without a server (or redis-py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.tiers.redis_memory import EvictionFacts, eviction_warning, footprint, size_class
from kvtier.tiers.redis_options import Endpoint, RedisOptions, parse_options

URL = "redis://127.0.0.1:6390/2"


def options(**kw: Any) -> RedisOptions:
    return parse_options({"url": URL, **kw}, "shared.options")


def test_defaults_and_the_endpoint() -> None:
    opts = options()
    assert opts.key_prefix == "kvtier:" and opts.max_connections == 16 and opts.retries == 1
    assert opts.endpoint == Endpoint(False, "127.0.0.1", 6390, 2, None, None)
    assert Endpoint.parse("rediss://cache.example:6380").redacted() == \
        "rediss://cache.example:6380/0"


@pytest.mark.parametrize(("kw", "message"), [
    ({"urll": URL}, r"shared\.options\.urll: unknown key"),
    ({"password": "x"}, r"shared\.options\.password: a password is never read from the config"),
    ({"url": "http://h/0"}, "expected redis://"),
    ({"url": "redis:///0"}, "names no host"),
    ({"url": "redis://h/zero"}, "database number"),
    ({"url": "redis://h:99999/0"}, "port must be a number"),
    ({"url": "redis://h/0?ssl_cert_reqs=none"}, "query parameters are not read"),
    ({"key_prefix": "has space"}, "key_prefix"),
    ({"max_connections": 0}, "max_connections"),
    ({"socket_timeout_s": 0}, "socket_timeout_s must be positive"),
    ({"retries": 11}, "retries"),
    ({"chunk_ttl_s": 0.5}, "chunk_ttl_s"),
    ({"verify": False}, "only for TLS"),
    ({"password_env": "not a name"}, "the \\*name\\* of an environment variable"),
    ({"password_env": "A", "password_file": "/f"}, "one password source"),
    ({"url": "redis://:pw@h/0", "password_env": "A"}, "one password source"),
    ({"url": "redis://alice:pw@h/0", "username": "bob"}, "differs"),
    ({"url": "redis://h/1", "cluster": True}, "only database 0"),
    ({"url": "redis://h/0", "key_prefix": "{app}:", "cluster": True},
     "no { or } with cluster: true"),
    ({"cluster": "yes"}, "cluster"),
    ({"nodes": ["h:1"]}, "nodes: only with cluster: true"),
    ({"url": "redis://h/0", "cluster": True, "nodes": ["h"]}, "not host:port"),
    ({"url": "redis://h/0", "cluster": True, "nodes": ["h:0"]}, "not host:port"),
    ({"url": "redis://h/0", "cluster": True, "nodes": ["a b:1"]}, "not host:port"),
])
def test_bad_options_name_the_key(kw: dict[str, Any], message: str) -> None:
    data = {"url": URL, **kw}
    if "urll" in kw:
        del data["url"]
    with pytest.raises(ConfigError, match=message):
        parse_options(data, "shared.options")


def test_a_password_in_the_url_is_cut_out_of_every_rendering() -> None:
    opts = options(url="redis://alice:p%40ss-Word9@cache:6379/1")
    assert opts.endpoint.password == "p@ss-Word9" and opts.endpoint.username == "alice"
    for text in (repr(opts), str(opts), repr(opts.endpoint), opts.endpoint.redacted()):
        assert "ss-Word9" not in text and "p%40" not in text
    assert opts.endpoint.redacted() == "redis://alice@cache:6379/1"
    with pytest.raises(ConfigError) as bad:
        options(url="redis://alice:p%40ss-Word9@cache:port/1")
    assert "ss-Word9" not in str(bad.value)


@pytest.mark.parametrize(("facts", "capacity", "ttl", "expected"), [
    (EvictionFacts(None, None), 1 << 30, None, None),  # CONFIG refused: nothing is known
    (EvictionFacts(0, "noeviction"), 1 << 30, None, "no maxmemory"),
    (EvictionFacts(0, "allkeys-lru"), 1 << 30, None, "no maxmemory"),
    (EvictionFacts(1 << 29, "noeviction"), 1 << 30, None, "refuses writes"),
    (EvictionFacts(2 << 30, "noeviction"), 1 << 30, None, None),  # headroom: kvtier sweeps
    (EvictionFacts(1 << 29, "allkeys-lru"), 1 << 30, None, None),
    (EvictionFacts(1 << 29, "volatile-lru"), 1 << 30, None, "set chunk_ttl_s"),
    (EvictionFacts(1 << 29, "volatile-lru"), 1 << 30, 86400.0, None),
])
def test_eviction_warnings(facts: EvictionFacts, capacity: int, ttl: float | None,
                           expected: str | None) -> None:
    warning = eviction_warning(facts, capacity, ttl)
    assert (warning is None) if expected is None else (expected in (warning or ""))


def test_footprints_follow_the_allocator() -> None:
    assert [size_class(n) for n in (1, 17, 129, 1000)] == [16, 32, 160, 1024]
    mib = 1 << 20
    assert size_class(mib) == mib and size_class(mib + 1) == mib + mib // 4
    assert footprint(mib) == mib + mib // 4 + 460, "the string header tips it into the next"
    assert footprint(4 * mib - 4096) == 4 * mib + 460
