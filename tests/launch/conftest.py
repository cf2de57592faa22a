"""The launcher's tests (``kvtier serve`` and its stack, without engines) import their helpers
(:mod:`launch_helpers`) from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
