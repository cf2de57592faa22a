"""Backends found at run time: a watched file changed under a running router (real aiohttp
stub backends on loopback), a bad file, a DNS name whose answers change, and the pool's
bookkeeping when members join, leave and drain."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from stubs import MODEL, completion, post, running_router, stubs

from kvtier.router.app import Router
from kvtier.router.backends import BackendPool, Membership
from kvtier.router.config import CostModel, DiscoveryConfig, RouterConfig
from kvtier.router.sources import BackendSpec, DnsName
from kvtier.router.strategies.session import PoolRing

INTERVAL_S = 0.5


def file_config(path: Path, **kw: Any) -> RouterConfig:
    found = DiscoveryConfig(file=path, interval_s=kw.pop("interval_s", INTERVAL_S),
                            node_port=kw.pop("node_port", None),
                            max_backends=kw.pop("max_backends", 64))
    return RouterConfig(backends=(), kvtier_servers=(), port=0, discovery=found,
                        health_interval_s=kw.pop("health_interval_s", 5.0), cost=CostModel(),
                        **kw)


def write(path: Path, urls: Sequence[str]) -> None:
    """As a careful writer does: a whole new file renamed over the old one."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("# backends\n" + "".join(f"{u}\n" for u in urls))
    os.replace(temporary, path)


def write_raw(path: Path, text: str) -> None:
    """``text`` as the whole file at once (a poll never sees it half-written)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


async def served_by(s: aiohttp.ClientSession, url: str, **kw: Any) -> str:
    status, _, headers = await post(s, f"{url}/v1/completions", completion(**kw))
    assert status == 200
    return headers["X-Kvtier-Backend"]


async def backends_doc(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(f"{url}/kvtier/backends") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


def gauge(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


def test_a_backend_added_to_the_file_takes_requests_within_one_interval(
        tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "backends"
        async with stubs(2) as (a, b):
            write(path, [a.url])
            async with running_router(file_config(path)) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                assert {await served_by(s, url) for _ in range(4)} == {a.url}
                write(path, [a.url, b.url])
                written = time.monotonic()
                while not b.seen:  # the bound is asserted below; this one only ends the loop
                    assert time.monotonic() - written < 5.0, "never reached"
                    await served_by(s, url)
                    await asyncio.sleep(0.01)
                took = b.seen[0]["at"] - written
                print(f"\nthe newcomer's first request {took * 1000:.0f} ms after the file "
                      f"changed (interval {INTERVAL_S * 1000:.0f} ms)")
                # a bound in rounds (a poll, then the newcomer's health check), not a
                # tight wall-clock one: a busy machine adds a little to each
                assert took < 2 * INTERVAL_S + 1.0
                assert {await served_by(s, url) for _ in range(4)} == {a.url, b.url}
                async with s.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                assert gauge(text, "kvtier_router_backends_discovered ") == [
                    "kvtier_router_backends_discovered 2.0"]
                assert 'kvtier_router_backend_changes_total{change="join"} 2.0' in text
                router.pool.check_integrity()

    asyncio.run(main())


def test_a_removed_backend_is_drained_and_no_request_is_lost(tmp_path: Path) -> None:
    """A streams slowly; the file drops it mid-stream: no new request reaches it, its stream
    finishes whole, requests sent all along are answered, and once drained it is gone
    from /kvtier/backends and /metrics."""
    async def main() -> None:
        path = tmp_path / "backends"
        async with stubs(1, tokens=20, token_s=0.1) as (a,), stubs(1) as (b,):
            write(path, [a.url])
            async with running_router(file_config(path)) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                statuses: list[int] = []
                stop = asyncio.Event()

                async def steady() -> None:  # requests all along (bounded: until stop)
                    for _ in range(400):
                        if stop.is_set():
                            return
                        status, _, _ = await post(s, f"{url}/v1/completions",
                                                  completion(max_tokens=1))
                        statuses.append(status)
                        await asyncio.sleep(0.02)

                async with s.post(f"{url}/v1/completions",
                                  json=completion(stream=True)) as stream:
                    assert stream.headers["X-Kvtier-Backend"] == a.url
                    first = await stream.content.readany()
                    assert first.startswith(b"data:")
                    load = asyncio.create_task(steady())
                    write(path, [b.url])
                    deadline = time.monotonic() + INTERVAL_S + 1.0
                    while (await backends_doc(s, url))["draining"] == []:
                        assert time.monotonic() < deadline, "the file change was not seen"
                        await asyncio.sleep(0.02)
                    doc = await backends_doc(s, url)
                    assert [r["url"] for r in doc["backends"]] == [b.url]
                    assert [r["url"] for r in doc["draining"]] == [a.url]
                    assert doc["draining"][0]["in_flight"] >= 1  # the stream (and maybe one more)
                    left_at = time.monotonic()
                    rest = await stream.read()
                assert rest.rstrip().endswith(b"data: [DONE]"), "the stream finished whole"
                deadline = time.monotonic() + 5
                while len(b.seen) < 3:  # the steady requests go on at the newcomer
                    assert time.monotonic() < deadline, "b never took the steady requests"
                    await asyncio.sleep(0.02)
                stop.set()
                await load
                assert statuses and set(statuses) == {200}, statuses
                late = [r for r in a.seen if r["at"] > left_at]
                assert late == [], "no request reached the backend after it left"
                assert a.seen and b.seen
                doc = await backends_doc(s, url)
                assert doc["draining"] == [] and [r["url"] for r in doc["backends"]] == [b.url]
                async with s.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                assert a.url not in text, "a gone backend's series are dropped"
                assert 'kvtier_router_backend_changes_total{change="leave"} 1.0' in text
                assert gauge(text, "kvtier_router_backends_draining ") == [
                    "kvtier_router_backends_draining 0.0"]
                router.pool.check_integrity()

    asyncio.run(main())


def test_a_bad_file_keeps_the_last_good_set_and_says_so_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kvtier.router")

    async def main() -> None:
        path = tmp_path / "backends"
        async with stubs(2) as (a, b):
            write(path, [a.url])
            async with running_router(file_config(path, interval_s=0.1)) as router, \
                    aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                write_raw(path, "http://10.9.9.9:8000\nnot-a-url\n")
                await asyncio.sleep(0.6)  # several rounds
                assert await served_by(s, url) == a.url
                write_raw(path, "")  # a writer caught half-way
                await asyncio.sleep(0.4)
                path.unlink()
                await asyncio.sleep(0.4)
                assert [bk.url for bk in router.pool] == [a.url]
                write(path, [b.url])
                written = time.monotonic()
                while [bk.url for bk in router.pool if bk.healthy] != [b.url]:
                    assert time.monotonic() - written < 3.0, "b never took over"
                    await asyncio.sleep(0.02)
                assert await served_by(s, url) == b.url
                # counted every round (at least two a phase), though logged once a kind
                assert router.metrics.discovery_failures._value.get() >= 6
        said = [r.getMessage() for r in caplog.records if "discovery:" in r.getMessage()]
        failures = [m for m in said if "failed" in m]
        assert len(failures) == 3, said  # once per kind of failure, not once a round
        assert "(line 2: 'not-a-url' is not an http(s)://HOST:PORT URL)" in failures[0]
        assert "keeping the 1 backends it listed last" in failures[0]
        assert "empty" in failures[1] and "cannot read it" in failures[2]
        assert sum("answers again" in m for m in said) == 1

    asyncio.run(main())


def test_dns_answers_change_the_backends_and_a_failure_keeps_them(
        tmp_path: Path) -> None:
    """The DNS source through the router, with a resolver the test controls (one real
    getaddrinfo test is in test_sources.py, one across addresses in test_discovery_netns.py)."""
    async def main() -> None:
        async with stubs(1) as (a,):
            port = int(a.url.rsplit(":", 1)[1])
            answers: list[list[str] | OSError] = [["127.0.0.1"]]

            async def resolve(host: str, _port: int) -> list[str]:
                assert host == "vllm.kvtier.svc.cluster.local"
                answer = answers[0] if len(answers) == 1 else answers.pop(0)
                if isinstance(answer, OSError):
                    raise answer
                return answer

            found = DiscoveryConfig(
                dns=DnsName.parse(f"http://vllm.kvtier.svc.cluster.local:{port}"),
                node_port=9, interval_s=0.1)
            config = RouterConfig(backends=(), kvtier_servers=(), port=0, discovery=found,
                                  health_interval_s=5.0)
            router = Router(config, resolve=resolve)
            await router.start()
            try:
                async with aiohttp.ClientSession() as s:
                    url = f"http://127.0.0.1:{router.port}"
                    assert await served_by(s, url) == a.url
                    doc = await backends_doc(s, url)
                    assert doc["backends"][0]["node"] == "http://127.0.0.1:9"
                    answers.append(socket.gaierror(socket.EAI_AGAIN, "Temporary failure"))
                    await asyncio.sleep(0.35)
                    assert await served_by(s, url) == a.url, "the last good set is kept"
                    answers.append([])  # nothing ready behind the name: kept too
                    await asyncio.sleep(0.35)
                    assert [b.url for b in router.pool] == [a.url]
                    answers.append(["127.0.0.1", "127.0.0.2"])
                    deadline = time.monotonic() + 2
                    while len(router.pool) < 2:
                        assert time.monotonic() < deadline
                        await asyncio.sleep(0.05)
                    assert router.discovery is not None and router.discovery.failing is None
            finally:
                await router.close()

    asyncio.run(main())


def test_an_empty_start_waits_for_backends_and_answers_503_meanwhile(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "backends"
        path.write_text("# nobody yet\n")
        async with stubs(1) as (a,):
            config = file_config(path, no_backend_wait_s=0.0)
            async with running_router(config) as router, aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{router.port}"
                status, doc, _ = await post(s, f"{url}/v1/completions", completion())
                assert status == 503 and "no backend" in doc["error"]["message"]
                async with s.get(f"{url}/health") as resp:
                    assert resp.status == 503
                write(path, [a.url])
                written = time.monotonic()
                while not any(bk.url == a.url and bk.healthy for bk in router.pool):
                    assert time.monotonic() - written < 2 * INTERVAL_S + 1.0, "never joined"
                    await asyncio.sleep(0.02)
                assert await served_by(s, url) == a.url

    asyncio.run(main())


# ---------------------------------------------------------------------- the pool's books

def pool_of(n: int = 0) -> BackendPool:
    return BackendPool(RouterConfig(backends=tuple(f"http://h{i}:1" for i in range(n)),
                                    kvtier_servers=(None,) * n))


def test_members_join_leave_drain_and_rejoin_with_indices_never_reused() -> None:
    pool = pool_of(2)
    first = list(pool)
    seen: list[tuple[str, str]] = []

    class Watch:
        def joined(self, b: Any) -> None:
            seen.append(("joined", b.url))

        def moved(self, b: Any) -> None:
            seen.append(("moved", b.url))

        def left(self, b: Any) -> None:
            seen.append(("left", b.url))

        def gone(self, b: Any) -> None:
            seen.append(("gone", b.url))

    pool.watchers.append(Watch())
    busy = first[0]
    pool.started(busy)
    change = pool.update([BackendSpec("http://h1:1"), BackendSpec("http://h2:1", "http://n2")])
    assert [b.url for b in change.joined] == ["http://h2:1"]
    assert change.left == (busy,) and busy.membership is Membership.LEAVING
    assert [b.url for b in pool] == ["http://h1:1", "http://h2:1"]
    assert pool.leaving == {"http://h0:1": busy}
    assert pool.candidates(MODEL) == []  # nobody checked yet: all out
    pool.check_integrity()
    newcomer = change.joined[0]
    assert newcomer.index == 2 and newcomer.node_url == "http://n2"
    pool.set_health(busy, True, "ok")  # what a late check says of it changes nothing
    assert busy.membership is Membership.LEAVING
    pool.finished(busy)
    assert busy.membership is Membership.GONE and pool.leaving == {}
    assert seen == [("joined", "http://h2:1"), ("left", "http://h0:1"), ("gone", "http://h0:1")]
    # back again: a new member with a new index (its old history is gone)
    again = pool.update([BackendSpec("http://h0:1"), BackendSpec("http://h2:1", "http://m2")])
    assert [b.index for b in again.joined] == [3] and again.moved == (newcomer,)
    assert newcomer.node_url == "http://m2" and ("gone", "http://h1:1") in seen
    assert ("moved", "http://h2:1") in seen
    # a leaving one listed again before it drained rejoins as itself
    pool.set_health(newcomer, True, "ok")
    pool.started(newcomer)
    pool.update([BackendSpec("http://h0:1")])
    assert newcomer.membership is Membership.LEAVING
    back = pool.update([BackendSpec("http://h0:1"), BackendSpec("http://h2:1", "http://m2")])
    assert back.joined == (newcomer,) and newcomer.membership is Membership.MEMBER
    # what its checks said while it drained was not heeded: out until its next check
    assert not newcomer.healthy and newcomer.reason.startswith("rejoined")
    assert newcomer not in pool.candidates(MODEL)
    pool.finished(newcomer)
    assert newcomer.membership is Membership.MEMBER
    pool.check_integrity()


def test_the_hash_ring_follows_the_members() -> None:
    pool = pool_of(3)
    ring = PoolRing(pool)
    before = ring.now()
    assert before is not None and ring.now() is before
    keys = [f"session-{i}".encode() for i in range(200)]
    placed = {k: before.pick(k, lambda _u: True) for k in keys}
    pool.update([BackendSpec(b.url) for b in pool] + [BackendSpec("http://h9:1")])
    after = ring.now()
    assert after is not None and after is not before
    moved = {k for k in keys if after.pick(k, lambda _u: True) != placed[k]}
    assert moved and all(after.pick(k, lambda _u: True) == "http://h9:1" for k in moved), \
        "a newcomer takes keys only for itself"
    pool.update([])
    assert ring.now() is None


# ---------------------------------------------------------------------- the command line

def route_args(*argv: str) -> RouterConfig:
    import argparse

    from kvtier.router.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return RouterConfig.from_args(parser.parse_args(["route", *argv]))


@pytest.mark.parametrize(("argv", "why"), [
    ((), "--backends: give at least one URL"),
    (("--backends", "http://a:1", "--backends-file", "f"), "give one source"),
    (("--backends-dns", "http://a:1", "--backends-file", "f"), "give one of them"),
    (("--backends-file", "f", "--kvtier-servers", "http://n:1"), "--kvtier-servers is for"),
    (("--backends", "http://a:1", "--kvtier-server-port", "8100"), "is for discovered"),
    (("--backends-file", "f", "--max-backends", "0"), "--max-backends: must be in"),
    (("--backends-file", "f", "--kvtier-server-port", "70000"), "--kvtier-server-port"),
    (("--backends-dns", "http://svc"), "give the backends' port"),
    (("--backends-file", "f", "--discovery-interval-s", "0"), "--discovery-interval-s"),
])
def test_discovery_flags_are_checked(argv: tuple[str, ...], why: str) -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match=why):
        route_args(*argv)


def test_discovery_flags_become_the_config(tmp_path: Path) -> None:
    config = route_args("--backends-dns", "http://vllm.ns.svc.cluster.local:8000",
                        "--kvtier-server-port", "8100", "--discovery-interval-s", "2",
                        "--max-backends", "10")
    assert config.backends == () and config.discovery is not None
    assert config.discovery.dns == DnsName("http", "vllm.ns.svc.cluster.local", 8000)
    assert (config.discovery.node_port, config.discovery.interval_s,
            config.discovery.max_backends) == (8100, 2.0, 10)
    found = route_args("--backends-file", str(tmp_path / "b")).discovery
    assert found is not None and found.file == tmp_path / "b" and found.node_port is None


def test_what_the_router_kept_of_a_backend_is_forgotten_once_it_is_gone() -> None:
    from kvtier.keys import ChunkKey
    from kvtier.router.discovery import MemberWatch
    from kvtier.router.history import DeviceHistory
    from kvtier.router.holdings import Holdings
    from kvtier.router.lookup import NodeLookups
    from kvtier.router.metrics import RouterMetrics

    pool = BackendPool(RouterConfig(backends=(), kvtier_servers=()))
    metrics, history, holdings = RouterMetrics(), DeviceHistory(60.0), Holdings(30.0)
    watch = MemberWatch(pool, metrics, history, holdings)
    watch.lookups = NodeLookups(None, 0.1)  # type: ignore[arg-type]  # no lookup is sent
    pool.watchers.append(watch)
    pool.update([BackendSpec("http://a:1", "http://a:2"), BackendSpec("http://b:1", "http://b:2")])
    a, b = pool.backends
    keys = [ChunkKey(bytes([i]) * 32) for i in range(4)]
    for backend in (a, b):
        holdings.sent(backend.node_url or "", keys)
        history.record(backend.index, keys, 100)
        watch.lookups._breakers[backend.node_url or ""] = object()  # type: ignore[assignment]
        metrics.in_flight.labels(backend.name).set(0)
        metrics.requests.labels(backend.name, "completions", "200").inc()
    pool.started(a)
    pool.update([BackendSpec("http://b:1", "http://b:2")])
    assert holdings.size("http://a:2") == 4, "kept while its requests finish"
    pool.finished(a)
    assert holdings.size("http://a:2") == 0 and holdings.size("http://b:2") == 4
    assert history.held(a.index, keys) == 0 and history.held(b.index, keys) == 4
    assert set(watch.lookups._breakers) == {"http://b:2"}
    text = "\n".join(f"{s.name}{s.labels}" for m in metrics.registry.collect()
                     for s in m.samples)
    assert "http://a:1" not in text and "http://b:1" in text
    pool.update([BackendSpec("http://b:1", "http://b:9")])  # its node server moved
    assert holdings.size("http://b:2") == 0


def test_a_node_servers_series_stays_while_another_member_uses_it() -> None:
    from kvtier.router.discovery import MemberWatch
    from kvtier.router.history import DeviceHistory
    from kvtier.router.holdings import Holdings
    from kvtier.router.metrics import RouterMetrics

    pool = BackendPool(RouterConfig(backends=(), kvtier_servers=()))
    metrics = RouterMetrics()
    pool.watchers.append(MemberWatch(pool, metrics, DeviceHistory(60.0), Holdings(30.0)))
    pool.update([BackendSpec("http://a:1", "http://n:2"), BackendSpec("http://b:1", "http://n:2")])
    metrics.lookup_failures.labels("http://n:2").inc()

    def series() -> bool:
        return any(s.labels.get("server") == "http://n:2"
                   for m in metrics.registry.collect() for s in m.samples)

    pool.update([BackendSpec("http://b:1", "http://n:2")])  # a is gone: b still uses n
    assert series()
    pool.update([])  # b is gone too: nobody uses n
    assert not series()


def test_kvtier_route_as_a_process_follows_its_file(tmp_path: Path) -> None:
    """The command line as a manifest gives it (uvloop when installed, the flags parsed)."""
    import signal
    import subprocess
    import sys

    from test_drain import ROOT, free_port, wait_healthy

    async def main() -> None:
        path = tmp_path / "backends.yaml"
        async with stubs(2) as (a, b):
            path.write_text(f"- {a.url}\n")
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier", "route", "--backends-file", str(path),
                 "--kvtier-server-port", "9", "--discovery-interval-s", "0.3",
                 "--port", str(port)],
                env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE)
            url = f"http://127.0.0.1:{port}"
            try:
                async with aiohttp.ClientSession() as s:
                    await wait_healthy(s, url, proc)
                    assert await served_by(s, url) == a.url
                    write_raw(path, f"- {a.url}\n- {{url: '{b.url}'}}\n")
                    deadline = time.monotonic() + 3
                    while not b.seen:
                        assert time.monotonic() < deadline, "b never joined"
                        await served_by(s, url)
                        await asyncio.sleep(0.02)
                    doc = await backends_doc(s, url)
                    assert sorted(r["node"] for r in doc["backends"]) == [
                        "http://127.0.0.1:9", "http://127.0.0.1:9"]
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=15) == 0
                log = proc.stderr.read().decode() if proc.stderr else ""
                assert "lists 2 backends (1 joined, 0 left)" in log
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)

    asyncio.run(main())
