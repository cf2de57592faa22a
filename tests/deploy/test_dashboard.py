"""deploy/grafana/kvtier.json against a running stack: every query names metrics (and labels)
that are really exported.

Without vLLM: a real node server (arena, disk tier, HTTP API) that stores, evicts and promotes
chunks, and a real ``kvtier route`` with a stub backend in front, its node lookups going to
that server; every query that names no ``vllm:`` metric is checked against their scrapes.
With vLLM (marked ``vllm``): ``kvtier serve`` on the demo model with its node server, the
router in front, and every query checked against the three scrapes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from store_helpers import MakeServer, client_load, client_store, keys

from kvtier.client import KvtierClient
from kvtier.metrics import StoreMetrics
from kvtier.router.metrics import RouterMetrics

from .dashboard_check import (
    Exported,
    check,
    dashboard_queries,
    registry_labels,
    scrape,
)
from .image_recipe import ROOT
from .promql_names import names

DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier.json"
SAMPLED = {  # what the stack below must really exercise, or the check proves little
    "kvtier_hits_total", "kvtier_bytes_total", "kvtier_evictions_total",
    "kvtier_breaker_state", "kvtier_used_bytes", "kvtier_capacity_bytes",
    "kvtier_io_seconds_bucket", "kvtier_lookup_chunks_total",
    "kvtier_router_decisions_total", "kvtier_router_requests_total",
    "kvtier_router_backend_up", "kvtier_router_first_byte_seconds_bucket",
    "kvtier_router_refused_total", "kvtier_router_decision_seconds_bucket",
    "kvtier_stack_part_up", "kvtier_stack_part_restarts_total", "kvtier_clients",
    "kvtier_router_loop_lag_seconds_count",
}


def _code_labels() -> dict[str, frozenset[str]]:
    return registry_labels(StoreMetrics(), RouterMetrics())


def _queries(*, vllm: bool) -> list[tuple[str, str]]:
    return [(t, e) for t, e in dashboard_queries(DASHBOARD)
            if vllm or not any(m.startswith("vllm:") for m in names(e).metrics)]


# ---------------------------------------------------------------------- the file itself

def test_the_dashboard_is_grafana_json_with_a_datasource_variable() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "kvtier" and doc["schemaVersion"] >= 36
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in doc["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    for title, expr in dashboard_queries(DASHBOARD):
        used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", expr)) - {"__rate_interval"}
        assert used <= set(variables), (title, used)


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    metrics = set().union(*(names(e).metrics for _t, e in dashboard_queries(DASHBOARD)))
    for needed in ("kvtier_hits_total", "vllm:time_to_first_token_seconds_bucket",
                   "kvtier_bytes_total", "vllm:kvtier_load_bytes_total",
                   "vllm:kvtier_store_bytes_total", "kvtier_breaker_state",
                   "kvtier_evictions_total", "kvtier_router_decisions_total",
                   "kvtier_router_backend_up", "up"):
        assert needed in metrics, needed


def test_the_name_reader_sees_what_a_query_names() -> None:
    found = names('histogram_quantile(0.99, sum by (le, tier) (rate('
                  'kvtier_io_seconds_bucket{direction="read"}[$__rate_interval])))')
    assert found.metrics == {"kvtier_io_seconds_bucket"}
    assert found.selectors[0].labels == {"direction"} and found.grouping == {"le", "tier"}
    joined = names('count by (job) (up == 0) / on (job) group_left (engine) '
                   'count by (job, engine) (vllm:x_total{engine!=""})')
    assert joined.metrics == {"up", "vllm:x_total"}
    assert joined.grouping == {"job", "engine"}
    assert joined.selectors[1].labels == {"engine"}
    for bad, why in (("sume(kvtier_hits_total)", "unknown function"),
                     ("sum(rate(kvtier_hits_total[5m])", "parenthesis"),
                     ('kvtier_hits_total{tier=~"$tier"}', "unknown dashboard variable")):
        with pytest.raises(ValueError, match=why):
            names(bad)


def test_a_query_naming_what_is_not_exported_is_caught() -> None:
    exported = Exported()
    exported.add_scrape("# TYPE kvtier_hits counter\nkvtier_hits_total{tier=\"arena\"} 1\n"
                        "# TYPE kvtier_evictions counter\n")
    labels = {"kvtier_evictions": frozenset({"tier", "cause"})}
    queries = [("a", "sum by (tier) (rate(kvtier_hit_total[5m]))"),
               ("b", 'kvtier_hits_total{direction="read"}'),
               ("c", "sum by (cause) (kvtier_hits_total)"),
               ("d", "sum by (cause) (rate(kvtier_evictions_total[5m]))"),
               ("e", "kvtier_evictions_bucket")]
    verdict = check(queries, exported, labels)
    assert {p[0] for p in verdict.problems} == {"a", "b", "c", "e"}, verdict.problems
    assert verdict.without_samples == {"kvtier_evictions_total"}


# ---------------------------------------------------------------------- a running stack

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _process(cmd: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _wait_answer(url: str, proc: subprocess.Popen[bytes], log: Path,
                 timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer:\n{log.read_text()[-3000:]}")


def _post(url: str, body: bytes, timeout_s: float = 60.0) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            answer.read()
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@contextmanager
def _router(tmp: Path, backend: str, node: str) -> Iterator[str]:
    """``kvtier route`` (cache strategy) in front of ``backend``, its lookups to ``node``,
    the stack parts read from a parts file; yields its base URL."""
    parts = tmp / "stack.json"
    parts.write_text(json.dumps({"parts": {"instance-1": {"state": "up", "restarts": 1}}}))
    port = _free_port()
    cmd = [sys.executable, "-m", "kvtier", "route", "--backends", backend,
           "--kvtier-servers", node, "--strategy", "cache", "--host", "127.0.0.1",
           "--port", str(port), "--health-interval-s", "0.5", "--parts-file", str(parts),
           "--max-body-bytes", "65536"]
    log = tmp / "router.log"
    with _process(cmd, log) as proc:
        url = f"http://127.0.0.1:{port}"
        _wait_answer(f"{url}/health", proc, log)
        yield url


def _send(router: str, prompt: str, n: int) -> None:
    body = json.dumps({"model": "stub", "prompt": prompt, "max_tokens": 4}).encode()
    for _ in range(n):
        assert _post(f"{router}/v1/completions", body) == 200
    too_large = json.dumps({"model": "stub", "prompt": "x" * 70_000}).encode()
    assert _post(f"{router}/v1/completions", too_large) == 413  # refused: too_large


def test_every_kvtier_query_names_what_the_node_server_and_router_export(
        make_server: MakeServer, tmp_path: Path) -> None:
    server = make_server(slots=4, disk_bytes=1 << 20, metrics_port=0)
    node = f"http://127.0.0.1:{server.metrics_port}"
    chunks = keys(8)
    with KvtierClient(server.socket_path) as client:
        client_store(client, chunks)           # 8 chunks through 4 arena slots: evictions
        client.lookup(chunks)
        assert any(p is not None for p in client_load(client, chunks[:2]))  # from disk
    backend_port = _free_port()
    stub = [sys.executable, "-m", "kvtier.bench.stub_backend", "--port", str(backend_port)]
    with _process(stub, tmp_path / "stub.log") as stub_proc:
        backend = f"http://127.0.0.1:{backend_port}"
        _wait_answer(f"{backend}/health", stub_proc, tmp_path / "stub.log")
        with _router(tmp_path, backend, node) as router:
            _send(router, "hello " * 50, 3)
            exported = Exported()
            exported.add_scrape(scrape(f"{node}/metrics"))
            exported.add_scrape(scrape(f"{router}/metrics"))
    queries = _queries(vllm=False)
    assert len(queries) >= 25, "most of the dashboard is kvtier's own"
    verdict = check(queries, exported, _code_labels())
    assert not verdict.problems, "\n".join(verdict.problems)
    unexercised = SAMPLED & verdict.without_samples
    assert not unexercised, f"the stack did not exercise {sorted(unexercised)}"


# ---------------------------------------------------------------------- with vLLM

def _connector_labels() -> dict[str, frozenset[str]]:
    """The connector's counters as vLLM exports them (kvtier.vllm.stats): vLLM's per-engine
    labels, and ``tier`` where the counter is by tier."""
    from kvtier.vllm.counters import METRICS

    return {f"vllm:kvtier_{name}": frozenset({"model_name", "engine"} | ({"tier"} if by_tier
                                                                          else set()))
            for name, (_doc, by_tier) in METRICS.items()}


@contextmanager
def _served(tmp: Path) -> Iterator[tuple[str, str]]:
    """``kvtier serve`` on the demo model with its node server's HTTP API; yields the
    instance's and the node server's base URLs."""
    from kvtier.demo import ensure_demo_model

    port, metrics_port = _free_port(), _free_port()
    ensure_demo_model()  # built before the clock starts; serve's default model
    cmd = [sys.executable, "-m", "kvtier", "serve", "--port", str(port),
           "--arena-size", "128MiB", "--disk-path", str(tmp / "disk"),
           "--disk-size", "1GiB", "--socket-path", str(tmp / "kvtier.sock"),
           "--kvtier-metrics-port", str(metrics_port), "--enforce-eager", "--dtype",
           "float32", "--max-model-len", "4096", "--num-gpu-blocks-override", "96",
           "--log-file", str(tmp / "vllm.log")]
    terminal = tmp / "terminal.txt"
    with open(terminal, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
    try:
        deadline = time.monotonic() + 600
        while "Ctrl-C stops it" not in terminal.read_text(errors="replace"):
            assert proc.poll() is None, terminal.read_text()[-3000:]
            assert time.monotonic() < deadline, terminal.read_text()[-3000:]
            time.sleep(1.0)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    finally:
        if proc.poll() is None:
            proc.terminate()  # kvtier serve stops vLLM and frees the arena on SIGTERM
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.vllm
@pytest.mark.slow
def test_every_query_names_what_vllm_the_node_server_and_the_router_export(
        tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    prompt = " ".join(f"item{i} of the list" for i in range(300))
    body = json.dumps({"model": "kvtier-demo", "prompt": prompt, "max_tokens": 4,
                       "temperature": 0.0}).encode()
    with _served(tmp_path) as (instance, node), _router(tmp_path, instance, node) as router:
        assert _post(f"{router}/v1/completions", body, 300) == 200    # stored in the arena
        assert _post(f"{instance}/reset_prefix_cache", b"{}") == 200
        assert _post(f"{router}/v1/completions", body, 300) == 200    # loaded from it
        deadline = time.monotonic() + 60
        while True:  # the connector's counters reach vLLM's frontend with its stats
            engine = scrape(f"{instance}/metrics")
            if "vllm:kvtier_loaded_tokens_total{" in engine or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        exported = Exported()
        for text in (engine, scrape(f"{node}/metrics"), scrape(f"{router}/metrics")):
            exported.add_scrape(text)
    verdict = check(_queries(vllm=True), exported, {**_code_labels(), **_connector_labels()})
    assert not verdict.problems, "\n".join(verdict.problems)
    sampled = SAMPLED | {"vllm:time_to_first_token_seconds_bucket",
                         "vllm:prompt_tokens_by_source_total",
                         "vllm:kvtier_loaded_tokens_total", "vllm:kvtier_load_bytes_total",
                         "vllm:kvtier_store_bytes_total", "kvtier_hits_total",
                         "vllm:num_requests_running"}
    sampled -= {"kvtier_evictions_total", "kvtier_bytes_total", "kvtier_io_seconds_bucket",
                "kvtier_router_refused_total"}  # a short run evicts nothing, reads no disk
    unexercised = sampled & verdict.without_samples
    assert not unexercised, f"the stack did not exercise {sorted(unexercised)}"
