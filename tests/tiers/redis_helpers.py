"""Building redis tiers on the test's own redis-server, and looking at it with plain redis-py."""

from __future__ import annotations

import os
from typing import Any

import pytest
from service_fixtures import ALLOW_MISSING

if os.environ.get(ALLOW_MISSING) == "1":  # a developer machine without the shared extra
    pytest.importorskip("redis")

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtier.config import TierConfig
from kvtier.services import RedisServer
from kvtier.tiers.redis import RedisTier

FAST = {"socket_timeout_s": 1.0, "connect_timeout_s": 0.5}




def redis_tier(url: str, name: str = "shared", *, capacity_bytes: int = 1 << 30,
               **options: Any) -> RedisTier:
    config = TierConfig(type="redis", name=name, capacity_bytes=capacity_bytes,
                        options={"url": url, **FAST, **options})
    tier = RedisTier.from_config(name, config)
    assert isinstance(tier, RedisTier)
    return tier


def plain(server: RedisServer) -> redis.Redis:
    """redis-py straight to the server, as another program (or an operator) would use it."""
    return redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0))
