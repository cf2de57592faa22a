"""The baseline script runs against the real services and reports every figure."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.services import RedisServer, SeaweedFS, SeaweedMount

from .baselines import measure_fs, measure_redis, measure_s3

pytestmark = pytest.mark.services


def test_every_baseline_is_measured(seaweedfs: SeaweedFS,
                                    make_seaweed_mount: Callable[..., SeaweedMount],
                                    redis_server: RedisServer) -> None:
    figures = {
        **measure_s3(seaweedfs, 4, 64 * 1024),
        **measure_fs(make_seaweed_mount(), make_seaweed_mount(), 4, 64 * 1024),
        **measure_redis(redis_server, 4, 64 * 1024),
    }
    assert {"s3_put_MBps", "s3_head_p99_ms", "fs_read_cold_other_mount_MBps",
            "fs_stat_p50_ms", "redis_exists_512_p50_ms"} <= figures.keys()
    assert all(value > 0 for value in figures.values()), figures
