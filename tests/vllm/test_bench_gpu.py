"""``kvtier bench gpu`` where it runs here: without CUDA it checks the layouts and says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the full check "
                    "runs instead (kvtier bench gpu)")
def test_without_cuda_the_round_trips_run_and_the_rest_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    arenas = set(Path("/dev/shm").glob("kvtier-gpucheck-*"))
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.gpu", "--json", str(out),
                           "--layouts", "LBNHC,LHBNC,KV_OUTER,MLA_3D"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout and "skipped" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["cuda"] is False and "still to be measured on a GPU" in figures["skipped"]
    assert set(figures["layouts"]) == {"LBNHC", "LHBNC", "KV_OUTER", "MLA_3D"}
    assert all(f["round_trip_equal"] for f in figures["layouts"].values())
    assert figures["layouts"]["LHBNC"]["runs_per_page"] == 2
    assert figures["targets_met"] == {"round_trip_equal": True}
    assert set(Path("/dev/shm").glob("kvtier-gpucheck-*")) == arenas  # its arena is gone
