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
from pathlib import Path
from typing import Any

import pytest

from hosts.fleet import API_PORT, DISCOVERY_S, KV_EVENTS_PORT, Fleet
from hosts.netns import Network, ns_pids, wait_for
from hosts.services import http, secret

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.services]
CHUNK = 256


def _prompts(model: str) -> dict[str, str | list[int]]:
    """Text prompts, and token-id prompts for vllm-router's kv_aware (the plain vLLM answers
    the same token ids)."""
    from transformers import AutoTokenizer

    from kvtier.demo.model import corpus_text

    text = corpus_text()
    run = uuid.uuid4().hex[:8]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts: dict[str, str | list[int]] = {
        "direct": f"hosts direct {run}\n{text[:9000]}",
        "routed": f"hosts routed {run}\n{text[1000:10000]}",
        "short": f"hosts short {run}: the quick brown fox"}
    for name in [*(f"kv_aware {n}" for n in range(len(KV_AWARE_HOLDERS))), "kv_aware fresh"]:
        ids = tokenizer(f"{name} {run} {uuid.uuid4().hex}\n{text[40:5000]}")["input_ids"]
        prompts[name] = list(ids)
    return prompts


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
        fleet.prompts = _prompts(model)
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


def test_a_router_finds_the_instances_by_a_dns_name(fleet: Fleet) -> None:
    """``kvtier route --backends-dns http://NAME:8000`` on a host whose resolver gives NAME
    both instance hosts' addresses (a headless Service's A records, in a hosts file): both are
    its backends, each with its node server at the same address, and it answers with the
    plain vLLM's tokens."""
    url = fleet.start_dns_router("fleet.kvh.test")
    wanted = sorted((i.url, i.node) for i in fleet.instances)

    def listed() -> list[tuple[str, str]]:
        status, doc = fleet.client.call(http, url + "/kvtier/backends")
        assert status == 200, (status, doc)
        return sorted((b["url"], b["node"]) for b in doc["backends"] if b["up"])

    wait_for(lambda: listed() == wanted, timeout_s=DISCOVERY_S + 10, every_s=0.2,
             what="the DNS router listing both instance hosts")
    for _ in range(2):
        answer = fleet.complete(url, fleet.prompts["routed"])
        assert answer["choices"][0]["text"] == fleet.expected["routed"]


def test_vllm_router_kv_aware_routes_each_prefix_to_the_host_that_holds_it(
        fleet: Fleet) -> None:
    """Each instance publishes its KV events on its own host (``tcp://*:PORT``: the host's
    addresses only), and a subscriber on another host receives them: no relay. vllm-router
    ``kv_aware`` on a host of its own subscribes to each instance's address. A prompt computed
    on one host, then sent through vllm-router (twice), is credited with the prefix that host's
    events announced and goes to that host, for each of 4 prefixes held by alternating hosts;
    a prompt no host computed is credited nothing. Token-id prompts: the only ones 0.1.17 makes
    a prefix decision for (it does not tokenize for HTTP workers). Texts equal the plain
    vLLM's for the same token ids."""
    from kvtier.bench.peers import ensure_vllm_router

    for instance in fleet.instances:
        frames = fleet.client.call(events_seen, instance.host.address, lambda i=instance:
                                   fleet.complete(i.url, f"events {uuid.uuid4().hex}\n"
                                                 + str(fleet.prompts["routed"])[:3000]))
        assert frames > 0, f"no KV events from {instance.host.address}:{KV_EVENTS_PORT}"
    url = fleet.start_vllm_router(str(ensure_vllm_router()))
    log = fleet.root / "vllm-router.log"
    for instance in fleet.instances:
        assert (f"subscriber for {instance.url} rank0 on "
                f"tcp://{instance.host.address}:{KV_EVENTS_PORT}") in router_log(log)
    for n, holder in enumerate(KV_AWARE_HOLDERS):
        name = f"kv_aware {n}"
        one = fleet.instances[holder]
        other = fleet.instances[1 - holder]
        seen = batches_from(log, one.url)
        first = fleet.complete(one.url, fleet.prompts[name])
        wait_for(lambda u=one.url, s=seen: batches_from(log, u) > s, timeout_s=15,
                 every_s=0.1, what=f"vllm-router reading {one.url}'s events of prefix {n}")
        before = served(fleet, one.url), served(fleet, other.url)
        for _ in range(2):
            made = len(decisions(log))
            again = fleet.complete(url, fleet.prompts[name])
            outcome, worker, credited = decisions(log)[made]
            print(f"prefix {n} on {one.url}: {outcome} {worker} credited {credited}")
            full = len(fleet.prompts[name]) // BLOCK * BLOCK  # the prompt's full blocks
            assert (outcome, worker) == ("prefix_cost", one.url)
            assert max(full - BLOCK, 4 * BLOCK) <= credited <= full, (credited, full)
            assert again["choices"][0]["text"] == first["choices"][0]["text"] \
                == fleet.expected[name]
        assert (served(fleet, one.url), served(fleet, other.url)) == (before[0] + 2, before[1])
    made = len(decisions(log))
    fresh = fleet.complete(url, fleet.prompts["kv_aware fresh"])
    assert fresh["choices"][0]["text"] == fleet.expected["kv_aware fresh"]
    assert decisions(log)[made][::2] == ("prefix_cost", 0), "credited a prefix no host computed"


BLOCK = 128
"""The CPU build's block size (vllm-router's ``--kv-event-block-size``)."""
KV_AWARE_HOLDERS = (1, 0, 1, 0)
"""Which instance computes each kv_aware prefix first."""


def router_log(path: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text())


def decisions(path: Path) -> list[tuple[str, str, int]]:
    """vllm-router's prefix decisions so far (its debug log): outcome, worker, credited
    prefix tokens."""
    return [(outcome, worker, int(credited)) for outcome, worker, credited in re.findall(
        r'KV prefix decision outcome="(\w+)" worker="([^"]+)" .*?credited_prefix_tokens=(\d+)',
        router_log(path))]


def batches_from(path: Path, url: str) -> int:
    """KV-event batches vllm-router applied from ``url``'s stream (its debug log)."""
    return router_log(path).count(f"live sequence advanced source={url} ")


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
