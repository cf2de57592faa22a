"""The endpoint counters a benchmark reads (kvtier.bench.prom): keys, sums, bad lines, a
fleet's pages summed."""

from __future__ import annotations

import http.server
import threading

from kvtier.bench import prom
from kvtier.bench.stacks import fleet_metrics

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
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
"""


def test_counters_are_summed_over_engines_and_keyed_by_source_or_tier() -> None:
    assert prom.parse(PAGE) == {
        prom.PROMPT: 1500.0,
        f"{prom.BY_SOURCE}|device": 120.0,
        f"{prom.BY_SOURCE}|external_unspecified": 7.0,
        f"{prom.KVTIER_LOADED}|arena": 64.0,
        prom.KVTIER_FAILED: 3.0,
        prom.PREEMPTIONS: 3.0,
    }


def test_malformed_lines_are_skipped_and_the_rest_is_read() -> None:
    broken = (PAGE + 'vllm:prompt_tokens_total{engine="2" 9\n'
              "vllm:prompt_tokens_total{engine=\"3\"} many\n"
              "vllm:prompt_tokens_total{engine=\"4\",engine=\"5\"} 1\n" + "\x00{\"\\" * 100)
    assert prom.parse(broken) == prom.parse(PAGE)
    assert prom.parse("<html>502 Bad Gateway</html>") == {}


ROUTER_PAGE = """# TYPE kvtier_router_decisions counter
kvtier_router_decisions_total{strategy="cache",reason="affinity"} 30.0
kvtier_router_decisions_total{strategy="cache",reason="load"} 4.0
kvtier_router_decisions_created{strategy="cache",reason="load"} 1.7e9
# TYPE kvtier_router_decision_seconds histogram
kvtier_router_decision_seconds_bucket{strategy="cache",le="+Inf"} 34.0
kvtier_router_decision_seconds_count{strategy="cache"} 34.0
kvtier_router_decision_seconds_sum{strategy="cache"} 0.17
# TYPE kvtier_router_keying_seconds histogram
kvtier_router_keying_seconds_count 30.0
kvtier_router_keying_seconds_sum 0.09
"""


class _Pages:
    """Prometheus pages served from 127.0.0.1, one per path; a path not set answers 404."""

    def __init__(self, pages: dict[str, str]) -> None:
        self.pages = pages
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = outer.pages.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Pages:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_fleets_pages_are_summed_and_the_routers_decisions_read_by_reason() -> None:
    with _Pages({"/a": PAGE, "/b": PAGE, "/router": ROUTER_PAGE}) as srv:
        total = prom.scrape_all([f"{srv.url}/a", f"{srv.url}/b", f"{srv.url}/router"])
        missing = prom.scrape_all([f"{srv.url}/a", f"{srv.url}/gone"])
    assert total is not None
    assert total[prom.PROMPT] == 3000.0
    assert total[f"{prom.BY_SOURCE}|device"] == 240.0
    assert total[f"{prom.DECISIONS}|affinity"] == 30.0
    assert total[f"{prom.DECISIONS}|load"] == 4.0
    assert missing is None  # a sum with a page missing would read as a drop
    before = {f"{prom.DECISIONS}|affinity": 10.0, prom.PROMPT: 1000.0}
    delta = prom.delta(before, total)
    assert delta["router_decisions"] == {"affinity": 20, "load": 4}
    # the router's own work: means over the interval's requests; no lookups timed, none said
    assert delta["router_work_ms"] == {"decision": 5.0, "keying": 3.0}
    later = {**total, f"{prom.ROUTER_WORK['decision']}_sum": 0.27,
             f"{prom.ROUTER_WORK['decision']}_count": 44.0}
    assert prom.delta(total, later)["router_work_ms"] == {"decision": 10.0}
    assert delta["preemptions"] == 6  # absent before: counted from 0
    assert "preemptions" not in prom.delta({}, prom.parse(ROUTER_PAGE))  # no vLLM page


def test_a_fleets_pages_are_its_instances_and_only_kvtiers_router() -> None:
    assert fleet_metrics(9000, 2, "kvtier") == ["http://127.0.0.1:9001/metrics",
                                               "http://127.0.0.1:9002/metrics",
                                               "http://127.0.0.1:9000/metrics"]
    assert fleet_metrics(9000, 2, "vllm-router") == ["http://127.0.0.1:9001/metrics",
                                                    "http://127.0.0.1:9002/metrics"]
