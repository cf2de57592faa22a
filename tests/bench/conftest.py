"""Benchmark-client tests import their helpers (the stub server) from this folder; the one
end-to-end module needs the demo model. The shared-tier benchmarks need boto3
(``pip install -e '.[shared]'``); see tests/services/conftest.py for the rule when it is
missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from service_fixtures import left_out

sys.path.insert(0, str(Path(__file__).parent))

NEEDS = {"test_shared_s3.py": "boto3"}
_, collect_ignore = left_out(NEEDS)


@pytest.fixture(scope="session")
def demo_model() -> str:
    from kvtier.demo import ensure_demo_model

    return str(ensure_demo_model())
