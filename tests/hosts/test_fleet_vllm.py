"""kvtier across hosts with real vLLM: 2 instance hosts, a shared-tier host, a router host.

Each instance host runs ``kvtier serve`` (vLLM CPU build, float32, bound to one core, its node
server on the host's address with a node token); SeaweedFS S3 on the shared host; ``kvtier
route --strategy cache`` on the router host; requests and ``kvtier verify`` come from a client
host. Tokens are compared with a plain vLLM (same flags, no connector) that answers the same
prompts first and is stopped before the fleet is asked. The engines start once for the module.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from hosts.fleet import API_PORT, DISCOVERY_S, KV_EVENTS_PORT, Fleet
from hosts.netns import Network, ns_pids, wait_for
from hosts.services import http, secret

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.services]
CHUNK = 256


def _prompts() -> dict[str, str]:
    from kvtier.demo.model import corpus_text

    text = corpus_text()
    run = uuid.uuid4().hex[:8]
    return {"direct": f"hosts direct {run}\n{text[:9000]}",
            "routed": f"hosts routed {run}\n{text[1000:10000]}",
            "short": f"hosts short {run}: the quick brown fox"}


@pytest.fixture(scope="module")
def fleet(can_make_hosts: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from kvtier.demo import ensure_demo_model

    model = str(ensure_demo_model())
    root = tmp_path_factory.mktemp("fleet")
    fleet = Fleet(Network(), root, secret("token"), secret("cluster"))
    try:
        for _ in range(2):
            fleet.add_instance()
        fleet.start_baseline(model)
        fleet.wait_serving(fleet.client.url(API_PORT), fleet.baseline, root / "baseline.log")
        fleet.prompts = _prompts()
        fleet.expected = {
            name: fleet.complete(fleet.client.url(API_PORT), p)["choices"][0]["text"]
            for name, p in fleet.prompts.items()}
        fleet.stop_baseline()
        for instance in fleet.instances:
            fleet.wait_serving(instance.url, instance.popen, instance.log)
        fleet.start_router()
        yield fleet
    finally:
        fleet.close()


def node_stats(fleet: Fleet, node: str) -> dict[str, Any]:
    status, doc = fleet.client.call(http, node + "/v1/stats", token=fleet.token)
    assert status == 200, (status, doc)
    return dict(doc)


def shared_chunks(fleet: Fleet, node: str) -> int:
    return int(node_stats(fleet, node)["tiers"]["shared"]["chunks"])


def test_a_prefix_computed_on_one_host_is_loaded_on_another_with_the_same_tokens(
        fleet: Fleet) -> None:
    one, two = fleet.instances
    prompt = fleet.prompts["direct"]
    before = shared_chunks(fleet, two.node)
    first = fleet.complete(one.url, prompt)
    chunks = first["usage"]["prompt_tokens"] // CHUNK
    assert chunks >= 4 and first["kv_transfer_params"]["kvtier"]["stored_chunks"] == chunks
    wait_for(lambda: shared_chunks(fleet, two.node) >= before + chunks, timeout_s=30,
             every_s=0.3, what="host 2's node server sees host 1's chunks in S3")
    second = fleet.complete(two.url, prompt)
    assert second["kv_transfer_params"]["kvtier"]["tokens"].get("shared") == chunks * CHUNK
    expected = fleet.expected["direct"]
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == expected


def test_through_the_router_tokens_equal_a_run_without_kvtier(fleet: Fleet) -> None:
    for name in ("routed", "short"):
        prompt = fleet.prompts[name]
        for _ in range(2):  # computed, then from a cache
            answer = fleet.complete(fleet.router_url, prompt)
            assert answer["choices"][0]["text"] == fleet.expected[name]


def test_the_node_api_refuses_lookups_without_the_token(fleet: Fleet) -> None:
    for instance in fleet.instances:
        for path in ("/v1/stats", "/v1/namespaces"):
            status, _ = fleet.client.call(http, instance.node + path)
            assert status == 401
        status, health = fleet.client.call(http, instance.node + "/healthz")
        assert status == 200 and health["ok"]


def test_kvtier_verify_passes_across_hosts(fleet: Fleet) -> None:
    result = fleet.client.run([sys.executable, "-m", "kvtier", "verify", "--url",
                               fleet.router_url], timeout_s=600, env=fleet.env)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in range(1, 6):
        assert re.search(rf"^\[{step}/5\] .* ok ", result.stdout, re.M), result.stdout
    assert "all 5 steps passed" in result.stdout
    assert "the router lists 2 instance(s) and their node servers" in result.stdout


def test_vllm_router_kv_aware_reads_each_hosts_kv_events_on_its_own_address(
        fleet: Fleet) -> None:
    """Each instance publishes its KV events on its own host (``tcp://*:PORT``: the host's
    addresses only), and a subscriber on another host receives them: no relay. vllm-router
    ``kv_aware`` on a host of its own subscribes to each instance's address and routes
    token-id completions (the only requests it makes a prefix decision for, in 0.1.17) with
    the text the instances give directly. Not asserted: that it routes a prefix to its
    holder: its decisions credited 0 prefix tokens here (``credited_prefix_tokens=0``)."""
    from transformers import AutoTokenizer

    from kvtier.bench.peers import ensure_vllm_router
    from kvtier.demo import ensure_demo_model

    for instance in fleet.instances:
        frames = fleet.client.call(events_seen, instance.host.address, lambda i=instance:
                                   fleet.complete(i.url, f"events {uuid.uuid4().hex}\n"
                                                 + fleet.prompts["routed"][:3000]))
        assert frames > 0, f"no KV events from {instance.host.address}:{KV_EVENTS_PORT}"
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    url = fleet.start_vllm_router(str(ensure_vllm_router()))
    for holder in (1, 0):
        text = f"kv_aware {holder} {uuid.uuid4().hex}\n" + fleet.prompts["routed"][40:6000]
        prompt = tokenizer(text)["input_ids"]
        first = fleet.complete(fleet.instances[holder].url, prompt)
        again = fleet.complete(url, prompt)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    log = re.sub(r"\x1b\[[0-9;]*m", "", (fleet.root / "vllm-router.log").read_text())
    for instance in fleet.instances:
        assert (f"subscriber for {instance.url} rank0 on "
                f"tcp://{instance.host.address}:{KV_EVENTS_PORT}") in log, log[-3000:]
    decisions = re.findall(r'KV prefix decision outcome="(\w+)"', log)
    assert decisions.count("prefix_cost") >= 2, decisions


def events_seen(address: str, request: Any) -> int:
    """Frames a ZMQ subscriber on this host gets from ``address``'s KV-event stream while
    ``request()`` runs (bounded: 5 s after it)."""
    import zmq

    context = zmq.Context()  # made here: its I/O thread is in this thread's host
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{address}:{KV_EVENTS_PORT}")
        time.sleep(0.5)  # the subscription reaches the publisher
        request()
        frames, deadline = 0, time.monotonic() + 5
        while time.monotonic() < deadline and frames < 100:
            if sub.poll(200):
                sub.recv_multipart()
                frames += 1
            elif frames:
                break
        return frames
    finally:
        sub.close(linger=0)
        context.term()


def test_a_third_host_joins_through_discovery_within_one_interval(fleet: Fleet) -> None:
    """A third instance host starts, is added to the router's backends file, is in the
    router's rotation within one discovery interval (+ its first health check), and takes
    requests: a burst of fresh prompts through the router reaches it."""
    third = fleet.add_instance()
    fleet.wait_serving(third.url, third.popen, third.log)
    fleet.list_backends()
    listed = time.monotonic()

    def in_rotation() -> bool:
        status, doc = fleet.client.call(http, fleet.router_url + "/kvtier/backends")
        assert status == 200, (status, doc)
        return any(b["url"] == third.url and b["up"] for b in doc["backends"])

    wait_for(in_rotation, timeout_s=DISCOVERY_S + 3.0, every_s=0.1,
             what="the router takes in the third host")
    took = time.monotonic() - listed
    print(f"third host in rotation {took:.2f} s after the file listed it")
    assert took <= DISCOVERY_S + 1.5, took  # one interval + a health check
    before = served(fleet, third.url)
    for burst in range(4):  # bounded: 4 bursts of 3 concurrent requests
        answers = burst_through_router(fleet, 3, f"join {burst}")
        assert all(status == 200 for status in answers), answers
        if served(fleet, third.url) > before:
            break
    assert served(fleet, third.url) > before, "no request reached the third host"


def burst_through_router(fleet: Fleet, n: int, label: str) -> list[int]:
    statuses: list[int] = []

    def one(k: int) -> None:
        body = {"model": "kvtier-demo", "prompt": f"{label} {k} {uuid.uuid4().hex}",
                "max_tokens": 8, "temperature": 0.0}
        status, _ = fleet.client.call(http, fleet.router_url + "/v1/completions", body,
                                      timeout_s=120, wait_s=90)
        statuses.append(status)

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return statuses


def test_a_host_whose_processes_are_killed_is_routed_around(fleet: Fleet) -> None:
    """Three clients send fresh prompts through the router, one at a time each; host 2's
    processes are killed (SIGKILL) once it has served some of them, and each client sends two
    more after the kill (at most 12 each, 240 s). At most the requests in flight at the kill
    fail; every request sent after it is answered, by the others."""
    victim = fleet.instances[1]
    log: list[tuple[float, float, bool]] = []  # (sent, answered, ok)
    lock = threading.Lock()
    killed = threading.Event()

    def client(c: int) -> None:
        deadline = time.monotonic() + 240
        after = 0
        for n in range(12):
            if time.monotonic() > deadline or after >= 2:
                return
            after += killed.is_set()
            body = {"model": "kvtier-demo", "prompt": f"{c}.{n} {uuid.uuid4().hex} fox",
                    "max_tokens": 8, "temperature": 0.0}
            sent = time.monotonic()
            try:
                status, _ = fleet.client.call(http, fleet.router_url + "/v1/completions",
                                              body, timeout_s=120, wait_s=90)
            except OSError:
                status = 0
            with lock:
                log.append((sent, time.monotonic(), status == 200))

    served_before = served(fleet, victim.url)
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: served(fleet, victim.url) > served_before
             or not any(t.is_alive() for t in threads),
             timeout_s=240, what="host 2 serving some of the requests before the kill")
    assert served(fleet, victim.url) > served_before, f"host 2 served none of {log}"
    for pid in ns_pids(victim.host.name):
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    killed.set()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), log
    failed = [(s, a) for s, a, ok in log if not ok]
    assert all(s < killed_at for s, _ in failed), f"a request sent after the kill failed: {log}"
    assert len(failed) <= 3, log  # at most one in flight per client
    assert [ok for s, _, ok in log if s > killed_at], "nothing was sent after the kill"
    print(f"{len(failed)} of {len(log)} failed (in flight at the kill)")
    assert f"backend {victim.url} is out" in (fleet.root / "router.log").read_text()


def served(fleet: Fleet, url: str) -> float:
    """Requests the vLLM at ``url`` finished (its /metrics)."""
    status, text = fleet.client.call(http, url + "/metrics")
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
               if line.startswith("vllm:request_success_total"))
