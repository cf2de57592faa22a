"""ServerLink against a real server: a call whose reply is lost is repeated only when that
is safe (the call can be repeated, or the server restarted and kept nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from rig import CHUNK, FakeEngine, layout, namespace
from store_helpers import sample, store_of

from kvtier.client import KvtierClient
from kvtier.errors import ServerUnavailable
from kvtier.keys import chunk_keys
from kvtier.protocol import Lease, Lookup, Op, R, Reserve
from kvtier.vllm.link import ServerLink

PROMPT = list(range(100, 200))  # 3 full chunks of 32


class LosesReplies(KvtierClient):
    """A client whose connection dies after the server answered one call of each type in
    ``lose``, before the reply is read: the server did the call, the client cannot know."""

    def __init__(self, socket_path: str, lose: set[type], **kw: Any) -> None:
        super().__init__(socket_path, **kw)
        self.lose = set(lose)
        self.sent: list[str] = []

    def _roundtrip(self, request: Op[R], extra_timeout: float = 0.0) -> R:
        reply = super()._roundtrip(request, extra_timeout)
        self.sent.append(type(request).__name__)
        if type(request) in self.lose:
            self.lose.discard(type(request))
            self._drop()
            raise ServerUnavailable("reply lost") from ConnectionResetError("reset by peer")
        return reply


@pytest.fixture
def engine(make_server: Any) -> Iterator[tuple[Any, FakeEngine]]:
    server = make_server(slots=16)
    eng = FakeEngine(server.socket_path)
    yield server, eng
    eng.close()


def _lossy(eng: FakeEngine, lose: set[type]) -> LosesReplies:
    client = LosesReplies(eng.socket, lose, name="rig-scheduler", timeout_s=2.0)
    eng.sched.link.close()
    eng.sched.link.client = client
    return client


def test_a_lost_reserve_is_not_repeated_and_what_it_reserved_is_aborted(
        engine: tuple[Any, FakeEngine]) -> None:
    server, eng = engine
    client = _lossy(eng, {Reserve})
    req = eng.add(PROMPT)
    eng.run(req)
    assert eng.finish(req)["stored_chunks"] == 0
    assert client.sent.count("Reserve") == 1 and "Abort" in client.sent
    store = store_of(server)
    assert store.stats()["reservations"] == 0  # no orphan held for lease_ttl_s
    assert sample(store, "kvtier_store_refusals_total", reason="present") == 0
    again = eng.add(PROMPT)  # the chunks can be stored at once
    eng.run(again)
    assert eng.finish(again)["stored_chunks"] == 3
    assert eng.sched.link.failures == 0  # a lost reply is not the server being down


def test_a_lost_lease_is_not_repeated(engine: tuple[Any, FakeEngine]) -> None:
    server, eng = engine
    req = eng.add(PROMPT)
    eng.run(req)
    eng.finish(req)
    client = _lossy(eng, {Lease})
    req = eng.add(PROMPT)
    assert client.sent.count("Lease") == 1
    assert store_of(server).stats()["leases"] == 1  # only the lost one (it expires)
    eng.run(req)  # the load failed: recomputed
    assert eng.blocks_match_recompute(req, 6)
    assert eng.finish(req)["failed_load_tokens"] == 96


def test_a_lost_lookup_is_repeated(engine: tuple[Any, FakeEngine]) -> None:
    _, eng = engine
    client = _lossy(eng, {Lookup})
    eng.add(PROMPT)
    assert client.sent.count("Lookup") == 3  # lost, repeated; then vLLM's second question


def test_a_reserve_is_repeated_once_the_server_restarted(make_server: Any) -> None:
    server = make_server(slots=16)
    socket = server.socket_path
    link = ServerLink(KvtierClient(socket, name="t", timeout_s=2.0), retry_interval_s=0.05)
    try:
        first = link.arena_name()
        server.stop(drain_s=1)
        make_server(slots=16, socket_path=socket)
        ns = namespace()
        keys = chunk_keys(ns.fingerprint, PROMPT, CHUNK)
        reply = link.call(Reserve(ns.fingerprint, keys, layout().payload_len, CHUNK), None)
        assert reply is not None and all(s is not None for s in reply.slots)
        assert link.arena_name() != first and link.failures == 0
    finally:
        link.close()
