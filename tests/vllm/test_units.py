"""Small pieces of the vLLM integration: the connector's config, its stats; the ttft figures."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.vllm.config import ConnectorConfig, RequestOptions


def test_kv_event_options_are_checked() -> None:
    cfg = ConnectorConfig.from_extra_config({"server_socket": "/s"})
    assert (cfg.kv_events_interval_s, cfg.kv_events_chunks) == (0.5, 16384)
    with pytest.raises(ConfigError, match="kv_events_chunks"):
        ConnectorConfig.from_extra_config({"server_socket": "/s", "kv_events_chunks": 0})
    with pytest.raises(ConfigError, match="kv_events_interval_s"):
        ConnectorConfig.from_extra_config({"server_socket": "/s", "kv_events_interval_s": -1})


def test_config_needs_exactly_one_way_to_the_server() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        ConnectorConfig.from_extra_config({})
    with pytest.raises(ConfigError, match="exactly one"):
        ConnectorConfig.from_extra_config({"server_socket": "/s", "server": {}})
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ConnectorConfig.from_extra_config({"server_socket": "/s", "chunk_tokens": 0})
    with pytest.raises(ConfigError, match="unknown key"):
        ConnectorConfig.from_extra_config({"server_socket": "/s", "chunk_token": 256})
    with pytest.raises(ConfigError, match=r"server\.arena\.size_bytes"):
        ConnectorConfig.from_extra_config({"server": {"arena": {"size_bytes": "lots"}}})


def test_embedded_server_slots_fit_one_chunk() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {"server": {"socket_path": "/tmp/x.sock", "arena": {"size_bytes": "64MiB"}}})
    assert cfg.socket_path == "/tmp/x.sock"
    assert cfg.server_config(payload_len=1 << 20).arena.slot_bytes == 4096 + (1 << 20)
    assert cfg.server_config(payload_len=5000).arena.slot_bytes == 4096 + 8192


def test_request_options_never_fail_a_request() -> None:
    assert RequestOptions.from_params({"kvtier": {"priority": 80}}).priority == 80
    assert RequestOptions.from_params({"kvtier": {"priority": 500}}) == RequestOptions()
    assert RequestOptions.from_params({"kvtier": "high"}) == RequestOptions()
    assert RequestOptions.from_params(None) == RequestOptions()
    assert not RequestOptions.from_params({"kvtier": {"load": False}}).load


def test_request_retention_and_release_parse_or_fall_back_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    parsed = RequestOptions.from_params({"kvtier": {"retention": {
        "priority": 80, "duration_s": 30, "ranges": [{"start": 0, "end": 512, "priority": 90}]}}})
    assert parsed.retention is not None and parsed.retention.duration_s == 30.0
    assert parsed.retention.ranges[0].end == 512
    assert RequestOptions.from_params({"kvtier": {"release": True}}).release
    for bad, said in (({"retention": {"priority": 80, "duration_s": -1}}, "duration_s"),
                      ({"retention": {"priority": 80}, "release": True}, "exclude"),
                      ({"priority": 50, "retention": {"priority": 80}}, "both set"),
                      ({"release": 1}, "release")):
        caplog.clear()
        assert RequestOptions.from_params({"kvtier": bad}) == RequestOptions()
        assert said in caplog.text, bad


def test_stats_aggregate_and_reach_prometheus() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.vllm.stats import KvtierPromMetrics, KvtierStats

    a = KvtierStats({"loaded_tokens|arena": 256, "store_bytes": 10})
    b = KvtierStats({"loaded_tokens|arena": 256, "loaded_tokens|disk": 512})
    total = a.aggregate(b)
    assert total.reduce() == {"loaded_tokens|arena": 512, "loaded_tokens|disk": 512,
                              "store_bytes": 10}
    assert KvtierStats({"store_bytes": 0}).is_empty()
    registry = CollectorRegistry()

    def counter(*args: object, **kw: object) -> Counter:
        return Counter(*args, registry=registry, **kw)  # type: ignore[arg-type]

    class Config:
        kv_transfer_config = None

    prom = KvtierPromMetrics(Config(), {Gauge: Gauge, Counter: counter,  # type: ignore[arg-type]
                                        Histogram: Histogram}, ["model_name", "engine"],
                             {0: ["m", "0"]})
    prom.observe(total.to_dict(), 0)
    got = registry.get_sample_value("vllm:kvtier_loaded_tokens_total",
                                    {"model_name": "m", "engine": "0", "tier": "disk"})
    assert got == 512


def test_ttft_bench_figures_carry_the_documented_keys() -> None:
    from kvtier.bench.ttft import _figures

    ttft = {"recompute": [2.0, 2.2, 1.8], "device": [0.05] * 3, "arena": [0.06] * 3,
            "disk": [0.1] * 3}
    f = _figures(8300, ttft, ratio=0.97, ratio_noop=0.99)
    assert {"prompt_tokens", "ttft_recompute_s", "ttft_device_s", "ttft_arena_s",
            "ttft_disk_s", "no_reuse_throughput_ratio"} <= set(f)
    assert f["ttft_recompute_s"] == 2.0 and f["arena_speedup"] == round(2.0 / 0.06, 2)
    assert f["targets_met"] == {"arena_speedup": True, "arena_over_device": True,
                                "no_reuse_throughput": True}
    assert not _figures(8300, ttft, ratio=0.9, ratio_noop=1.0)["targets_met"][
        "no_reuse_throughput"]
