"""Deploy tests import their helpers (kube, pod_files) from this folder, and the router's
stub backends (stubs) from tests/router."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1] / "router"))
