"""Benchmark-client tests import their helpers (the stub server) from this folder; the one
end-to-end module needs the demo model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def demo_model() -> str:
    from kvtier.demo import ensure_demo_model

    return str(ensure_demo_model())
