"""``kvtier bench route`` runs the stub, the router and the client, and writes its figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.router.cli import STRATEGY_NAMES
from kvtier.router.strategies import STRATEGIES


def test_bench_route_prints_and_writes_the_figures(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "route.json"
    assert main(["bench", "route", "--requests", "20", "--concurrency", "4",
                 "--duration-s", "0.5", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for name in ("whole", "stream_first_chunk"):
        row = figures[name]
        assert 0 < row["direct"]["p50_ms"] <= row["direct"]["p99_ms"]
        assert row["routed"]["p50_ms"] > 0 and "added_p99_ms" in row
    assert figures["throughput"]["direct_rps"] > 0 and figures["throughput"]["routed_rps"] > 0
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "stream_first_chunk" in printed


def test_the_command_offers_every_registered_strategy() -> None:
    assert sorted(STRATEGY_NAMES) == sorted(STRATEGIES)
