"""The s3 tier's tests need boto3 (``pip install -e '.[shared]'``).

Without it their modules fail to collect, with the ImportError, unless
KVTIER_ALLOW_MISSING_SERVICES=1 (a developer machine): then they are left out and the header
says so (the same rule as tests/services/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os

from service_fixtures import ALLOW_MISSING

NEEDS = {"test_s3.py": "boto3", "test_s3_config.py": "boto3", "test_s3_faults.py": "boto3"}
MISSING = sorted({m for m in NEEDS.values() if importlib.util.find_spec(m) is None})
collect_ignore = (
    [name for name, module in NEEDS.items() if module in MISSING]
    if os.environ.get(ALLOW_MISSING) == "1" else []
)


def pytest_report_header() -> str | None:
    if not MISSING:
        return None
    return (f"kvtier tiers: {', '.join(MISSING)} not installed (pip install -e '.[shared]')"
            + ("; their tests are left out" if collect_ignore else ""))
