"""The service tests need the shared tiers' client libraries (``pip install -e '.[shared]'``).
The fixtures themselves live in tests/service_fixtures.py.

Without them their modules fail to collect, with the ImportError, unless
KVTIER_ALLOW_MISSING_SERVICES=1 (a developer machine): then they are left out and the header
says so (``service_fixtures.left_out``).
"""

from __future__ import annotations

from service_fixtures import left_out

NEEDS = {"test_seaweedfs_s3.py": "boto3", "test_redis_server.py": "redis",
         "test_baselines.py": "boto3"}
MISSING, collect_ignore = left_out(NEEDS)


def pytest_report_header() -> str | None:
    if not MISSING:
        return None
    return (f"kvtier services: {', '.join(MISSING)} not installed (pip install -e '.[shared]')"
            + ("; their tests are left out" if collect_ignore else ""))
