"""``bench ttft --lmcache``: the LMCache figures next to kvtier's, by hand."""

from __future__ import annotations

import pytest

from kvtier.bench.ttft import _lmcache_figures


def test_lmcache_figures_are_medians_set_against_kvtiers() -> None:
    cases = {"recompute": [2.0, 2.6, 2.2], "device": [0.06, 0.05, 0.07],
             "hit": [0.5, 0.4, 0.8]}
    f = _lmcache_figures(cases, {"ttft_arena_s": 0.1, "ttft_device_s": 0.045})
    assert f["ttft_lmcache_hit_s"] == 0.5 and f["ttft_lmcache_recompute_s"] == 2.2
    assert f["lmcache_speedup"] == pytest.approx(4.4)
    assert f["lmcache_hit_over_arena"] == pytest.approx(5.0)
    assert f["lmcache_http_overhead_s"] == pytest.approx(0.015)
