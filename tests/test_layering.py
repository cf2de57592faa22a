"""The core imports neither vLLM nor torch (DESIGN: dependencies point one way)."""

from __future__ import annotations

import subprocess
import sys

CORE = [
    "kvtier.errors", "kvtier.config", "kvtier.registry", "kvtier.keys", "kvtier.codec",
    "kvtier.policies", "kvtier.tiers", "kvtier.tiers.disk", "kvtier.tiers.arena",
    "kvtier.store", "kvtier.server", "kvtier.client", "kvtier.cli",
]


def test_core_runs_with_vllm_and_torch_blocked() -> None:
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'torch'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {CORE!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
