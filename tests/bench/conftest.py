"""Benchmark-client tests import their helpers (the stub server) from this folder; the one
end-to-end module needs the demo model. The shared-tier benchmarks need boto3
(``pip install -e '.[shared]'``); see tests/services/conftest.py for the rule when it is
missing."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from service_fixtures import ALLOW_MISSING

sys.path.insert(0, str(Path(__file__).parent))

NEEDS = {"test_shared_s3.py": "boto3"}
collect_ignore = (
    [name for name, module in NEEDS.items() if importlib.util.find_spec(module) is None]
    if os.environ.get(ALLOW_MISSING) == "1" else []
)


@pytest.fixture(scope="session")
def demo_model() -> str:
    from kvtier.demo import ensure_demo_model

    return str(ensure_demo_model())
