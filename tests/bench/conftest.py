"""The shared-tier benchmarks need boto3 (``pip install -e '.[shared]'``); see
tests/services/conftest.py for the rule when it is missing."""

from __future__ import annotations

import importlib.util
import os

from service_fixtures import ALLOW_MISSING

NEEDS = {"test_shared_s3.py": "boto3"}
collect_ignore = (
    [name for name, module in NEEDS.items() if importlib.util.find_spec(module) is None]
    if os.environ.get(ALLOW_MISSING) == "1" else []
)
