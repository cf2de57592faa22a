"""``kvtier route --strategy cache`` in front of two ``kvtier serve`` instances (vLLM CPU
build, demo model, float32, greedy) that share one ``fs`` tier, each with its own node server
and arena, each bound to a core of its own.

- The router's prompt tokens equal vLLM's (``/tokenize``) for completions and chat, and the
  keys it computes from them are the keys the engine stored: its node server holds every one.
- A long prompt sent twice through the router lands on both instances: the first time on
  one; the second time that one is busy with other clients' long prompts (and the router has
  seen them in its /metrics), so load wins and the other instance serves it from the shared
  tier, with the text of the first answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.demo.model import corpus_text
from kvtier.prom import samples
from kvtier.router.keys import NamespaceInfo, Renderers, RequestKeys

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "kvtier-demo"
PROMPT = corpus_text() * 2  # about 4150 tokens: 16 full chunks
CHAT = [{"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": [{"type": "text", "text": corpus_text()},
                                     {"type": "text", "text": "What is this about?"}]}]


@dataclass
class Instance:
    proc: subprocess.Popen[bytes]
    port: int
    node_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def node_url(self) -> str:
        return f"http://127.0.0.1:{self.node_port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 180) -> tuple[int, Any, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, got = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    text = raw.decode()
    try:
        return status, json.loads(text), got
    except ValueError:
        return status, text, got


def start_instance(root: Path, name: str, core: int, shared: Path) -> Instance:
    folder = root / name
    folder.mkdir()
    # an arena that keeps every prompt of the module (~1 MiB a chunk): a decision's reason
    # must not depend on whether x's arena already lost a prompt to the busy ones
    config = {"socket_path": str(folder / "kvtier.sock"), "arena": {"size_bytes": "512MiB"},
              "tiers": [{"type": "fs", "name": "shared", "capacity_bytes": "1GiB",
                         "options": {"path": str(shared), "journal_interval_s": 0.1,
                                     "poll_s": 0.2, "sweep_interval_s": 600}}]}
    (folder / "server.yaml").write_text(yaml.safe_dump(config))
    port, node_port = free_port(), free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONPATH": str(ROOT)}
    log = folder / "serve.log"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--server-config",
           str(folder / "server.yaml"), "--kvtier-metrics-port", str(node_port),
           "--port", str(port), "--dtype", "float32", "--max-model-len", "10240",
           "--num-gpu-blocks-override", "160"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Instance(proc, port, node_port, log)


def wait_ready(inst: Instance, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert inst.proc.poll() is None, inst.log.read_text()[-3000:]
        try:
            if call(f"{inst.url}/v1/models", timeout=5)[0] == 200 and \
                    call(f"{inst.node_url}/v1/namespaces", timeout=5)[1]:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(inst.log.read_text()[-3000:])


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Instance], str]]:
    from kvtier.demo import ensure_demo_model

    ensure_demo_model()
    root = tmp_path_factory.mktemp("kvtier-route")
    shared = root / "shared"
    instances = [start_instance(root, name, core, shared)
                 for core, name in enumerate(("a", "b"))]
    router = None
    try:
        for inst in instances:
            wait_ready(inst)
        port = free_port()
        router_log = root / "route.log"
        with open(router_log, "wb") as out:
            router = subprocess.Popen(
                [sys.executable, "-m", "kvtier", "route", "--strategy", "cache",
                 "--backends", ",".join(i.url for i in instances),
                 "--kvtier-servers", ",".join(i.node_url for i in instances),
                 "--port", str(port), "--health-interval-s", "0.5", "--log-level", "debug"],
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if call(f"{url}/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, \
                router_log.read_text()[-3000:]
            time.sleep(0.2)
        yield instances, url
    finally:
        if router is not None:
            stop(router)
        for inst in instances:
            stop(inst.proc)


def namespace(inst: Instance) -> NamespaceInfo:
    spaces = call(f"{inst.node_url}/v1/namespaces")[1]
    parsed = [NamespaceInfo.parse(doc) for doc in spaces]
    assert parsed and parsed[-1] is not None
    return parsed[-1]


def router_keys(inst: Instance, endpoint: str, body: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The tokens and keys kvtier.router computes for ``body`` on this instance."""
    async def compute() -> tuple[list[int], list[str]]:
        keys = RequestKeys(endpoint, body, Renderers())
        ns = namespace(inst)
        tokens = await keys.tokens(ns.tokenizer)
        got = await keys.keys(ns)
        assert tokens is not None and got is not None
        return list(tokens), [k.hex() for k in got.keys]
    return asyncio.run(compute())


def held(inst: Instance, keys: list[str]) -> list[str]:
    status, doc, _ = call(f"{inst.node_url}/v1/lookup", {"keys": keys})
    assert status == 200
    return list(doc["tiers"])


def others(metrics: str, backend: str) -> float:
    """The router's ``kvtier_router_backend_others`` for ``backend`` (0 before it has one)."""
    return next((s.value for s in samples(metrics, ("kvtier_router_backend_others",))
                 if s.labels.get("backend") == backend), 0.0)


def by_url(instances: list[Instance], url: str) -> Instance:
    return next(i for i in instances if i.url == url)


def test_router_keys_equal_the_engines(stack: tuple[list[Instance], str]) -> None:
    instances, url = stack
    cases = [("completions", "/v1/completions", "/tokenize", {"prompt": PROMPT}),
             ("chat", "/v1/chat/completions", "/tokenize", {"messages": CHAT})]
    for endpoint, path, tokenize, extra in cases:
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, **extra}
        tokens, keys = router_keys(instances[0], endpoint, body)
        status, vllm_tokens, _ = call(f"{instances[0].url}{tokenize}",
                                      {"model": MODEL, **extra})
        assert status == 200 and vllm_tokens["tokens"] == tokens, f"{endpoint}: tokenization"
        status, doc, headers = call(f"{url}{path}", body)
        assert status == 200, doc
        served = by_url(instances, headers["X-Kvtier-Backend"])
        acct = doc["kv_transfer_params"]["kvtier"]
        assert acct["prompt_tokens"] == len(tokens)
        assert len(keys) == len(tokens) // 256 and keys
        assert held(served, keys) == ["arena"] * len(keys), \
            f"{endpoint}: the engine stored exactly the keys the router computed"


def test_a_prompt_sent_twice_lands_on_both_and_the_second_loads_the_shared_tier(
        stack: tuple[list[Instance], str]) -> None:
    instances, url = stack
    body = {"model": MODEL, "prompt": "Once more: " + PROMPT, "max_tokens": 8,
            "temperature": 0.0}
    _, keys = router_keys(instances[0], "completions", body)
    started = time.monotonic()
    status, first, headers = call(f"{url}/v1/completions", body)
    first_s = time.monotonic() - started
    assert status == 200, first
    x = by_url(instances, headers["X-Kvtier-Backend"])
    y = next(i for i in instances if i is not x)
    deadline = time.monotonic() + 30
    while held(y, keys) != ["shared"] * len(keys):
        assert time.monotonic() < deadline, "the other node never saw the shared chunks"
        time.sleep(0.2)
    # other clients keep x busy: three long prompts sent to it directly
    busy = subprocess.Popen([sys.executable, "-c", (
        "import json, urllib.request, random, threading\n"
        "def send(seed):\n"
        "    rng = random.Random(seed)\n"
        f"    body = {{'model': '{MODEL}', 'max_tokens': 48, 'temperature': 0.0,\n"
        "            'prompt': [rng.randrange(3, 1600) for _ in range(9000)]}\n"
        f"    req = urllib.request.Request('{x.url}/v1/completions', json.dumps(body).encode(),\n"
        "                                 {'Content-Type': 'application/json'})\n"
        "    urllib.request.urlopen(req, timeout=300).read()\n"
        "sent = [threading.Thread(target=send, args=(seed,)) for seed in (7, 8, 9)]\n"
        "for t in sent: t.start()\n"
        "for t in sent: t.join()\n")])
    try:
        # the router reads x's queue from its /metrics each health round: wait until it has
        # (a fixed sleep raced the poll, and on a fast machine the prompts themselves)
        deadline = time.monotonic() + 60
        while others(call(f"{url}/metrics")[1], x.url) < 2:
            assert busy.poll() is None and time.monotonic() < deadline, \
                "the router never saw x's queue"
            time.sleep(0.1)
        started = time.monotonic()
        status, second, headers = call(f"{url}/v1/completions", body)
        second_s = time.monotonic() - started
        assert status == 200, second
        print(f"\nfirst: {x.url} {first_s:.2f} s {first['kv_transfer_params']['kvtier']}"
              f"\nsecond (first busy): {headers['X-Kvtier-Backend']} {second_s:.2f} s "
              f"{second['kv_transfer_params']['kvtier']}")
        assert headers["X-Kvtier-Backend"] == y.url, "load wins: x is busy, y can load it"
        tokens = second["kv_transfer_params"]["kvtier"]["tokens"]
        assert tokens.get("shared") == len(keys) * 256, tokens
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        busy.wait(timeout=300)
    _, metrics, _ = call(f"{url}/metrics")
    assert 'kvtier_router_hit_source_total{actual="shared",predicted="shared"} 1.0' in metrics
    assert 'kvtier_router_decisions_total{reason="load",strategy="cache"}' in metrics


def start_router(root: Path, instances: list[Instance], *extra: str
                 ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = root / f"route-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "route", "--strategy", "cache",
             "--backends", ",".join(i.url for i in instances),
             "--kvtier-servers", ",".join(i.node_url for i in instances),
             "--port", str(port), "--health-interval-s", "0.5", *extra],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if call(f"{url}/health", timeout=5)[0] == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop(proc)
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.2)


def len_prompt(answer: dict[str, Any]) -> int:
    return int(answer["kv_transfer_params"]["kvtier"]["prompt_tokens"])


def test_tenant_b_never_loads_or_learns_of_tenant_as_prefix(
        stack: tuple[list[Instance], str], tmp_path: Path) -> None:
    """The hostile tenant, through real engines: B sends A's prompt word for word (and A's
    own cache salt) and gets the same text, computed from scratch, with nothing about A."""
    instances, _url = stack
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": {
        "alice": {"api_keys": ["key-of-alice-0123456789"], "may_see_tier_details": True},
        "bob": {"api_keys": ["key-of-bob-9876543210"], "may_see_tier_details": True},
        "carol": {"api_keys": ["key-of-carol-5555555555"]}}}))
    tenants.chmod(0o600)
    router, url = start_router(tmp_path, instances, "--tenants-file", str(tenants))
    body = {"model": MODEL, "prompt": "Tenant story: " + PROMPT, "max_tokens": 8,
            "temperature": 0.0, "cache_salt": "shared-salt"}

    def ask(key: str) -> dict[str, Any]:
        status, doc, _ = call(f"{url}/v1/completions", body, {"Authorization": f"Bearer {key}"})
        assert status == 200, doc
        return dict(doc)

    try:
        first = ask("key-of-alice-0123456789")
        again = ask("key-of-alice-0123456789")
        bob = ask("key-of-bob-9876543210")
        carol = ask("key-of-carol-5555555555")
    finally:
        stop(router)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 256, "alice's second request hits her own cache"
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, \
        "bob's identical prompt, with alice's client salt, reuses nothing of hers"
    bob_tokens = bob["kv_transfer_params"]["kvtier"]["tokens"]
    assert bob_tokens["device"] == 0 and bob_tokens["recomputed"] == len_prompt(bob), \
        bob_tokens
    assert bob["choices"][0]["text"] == first["choices"][0]["text"], "same text, recomputed"
    assert (carol.get("kv_transfer_params") or {}).get("kvtier") is None, \
        "a tenant not allowed tier details gets none"
