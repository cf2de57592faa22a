"""The s3 and redis tiers' tests need boto3 and redis-py (``pip install -e '.[shared]'``).

Without them their modules fail to collect, with the ImportError, unless
KVTIER_ALLOW_MISSING_SERVICES=1 (a developer machine): then they are left out and the header
says so (``service_fixtures.left_out``).
"""

from __future__ import annotations

from service_fixtures import left_out

NEEDS = {"test_s3.py": "boto3", "test_s3_config.py": "boto3", "test_s3_faults.py": "boto3",
         "test_redis.py": "redis", "test_redis_auth.py": "redis",
         "test_redis_eviction.py": "redis", "test_redis_options.py": "redis",
         "test_redis_hostile.py": "redis", "test_s3_hostile.py": "boto3",
         "test_redis_cluster.py": "redis", "test_redis_cluster_hostile.py": "redis"}
MISSING, collect_ignore = left_out(NEEDS)


def pytest_report_header() -> str | None:
    if not MISSING:
        return None
    return (f"kvtier tiers: {', '.join(MISSING)} not installed (pip install -e '.[shared]')"
            + ("; their tests are left out" if collect_ignore else ""))
