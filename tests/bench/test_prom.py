"""The endpoint counters a benchmark reads (kvtier.bench.prom.parse): keys, sums, bad lines."""

from __future__ import annotations

from kvtier.bench import prom

PAGE = """# HELP vllm:prompt_tokens Number of prefill tokens processed.
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 500.0
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 100.0
vllm:prompt_tokens_cached_by_source_total{engine="1",source="device"} 20.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="external_unspecified"} 7.0
vllm:kvtier_loaded_tokens_total{engine="0",tier="arena"} 64.0 1700000000000
vllm:kvtier_failed_load_tokens_total{engine="0"} 3.0
vllm:generation_tokens_total{engine="0"} 77.0
"""


def test_counters_are_summed_over_engines_and_keyed_by_source_or_tier() -> None:
    assert prom.parse(PAGE) == {
        prom.PROMPT: 1500.0,
        f"{prom.BY_SOURCE}|device": 120.0,
        f"{prom.BY_SOURCE}|external_unspecified": 7.0,
        f"{prom.KVTIER_LOADED}|arena": 64.0,
        prom.KVTIER_FAILED: 3.0,
    }


def test_malformed_lines_are_skipped_and_the_rest_is_read() -> None:
    broken = (PAGE + 'vllm:prompt_tokens_total{engine="2" 9\n'
              "vllm:prompt_tokens_total{engine=\"3\"} many\n"
              "vllm:prompt_tokens_total{engine=\"4\",engine=\"5\"} 1\n" + "\x00{\"\\" * 100)
    assert prom.parse(broken) == prom.parse(PAGE)
    assert prom.parse("<html>502 Bad Gateway</html>") == {}
