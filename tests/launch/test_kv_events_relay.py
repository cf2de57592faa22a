"""The relay of the instances' KV events (``kv_aware``), with real ZMQ sockets: a publisher
bound on an ipc path as vLLM 0.32 binds it, the relay, and subscribers connected to
127.0.0.1 as vllm-router connects. Messages pass unchanged and in order, each stream to its
own port; a restarted publisher is followed; a taken port fails at start, naming it; a slow
or absent subscriber never blocks the relay."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvtier.launch.kv_events import KvEventRelay, instance_events_config
from kvtier.ports import free_port


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _publisher(ctx: zmq.Context[zmq.Socket[bytes]], path: Path) -> zmq.Socket[bytes]:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"ipc://{path}")
    return pub


def _subscriber(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


@pytest.fixture
def one_stream(tmp_path: Path) -> Iterator[tuple[Path, int, KvEventRelay]]:
    """A started relay of one stream: its ipc path, its port, the relay (stopped after)."""
    path, port = tmp_path / "a.kv", free_port()
    relay = KvEventRelay([f"ipc://{path}"], [port])
    relay.start()
    yield path, port, relay
    relay.stop()


def _until_received(pub: zmq.Socket[bytes], sub: zmq.Socket[bytes]) -> None:
    """PUB/SUB joins are asynchronous: publish a marker until one arrives end to end."""
    sub.setsockopt(zmq.RCVTIMEO, 100)
    for _ in range(100):
        pub.send_multipart([b"kv-events", b"join", b""])
        try:
            while sub.recv_multipart()[1] != b"join":
                pass
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("nothing came through the relay in 10 s")
    while True:  # drain the other markers
        try:
            sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, 5000)


def test_each_stream_reaches_its_own_port_unchanged_and_in_order(
        tmp_path: Path, context: zmq.Context[zmq.Socket[bytes]]) -> None:
    paths = [tmp_path / "a.kv", tmp_path / "b.kv"]
    ports = [free_port(), free_port()]
    relay = KvEventRelay([f"ipc://{p}" for p in paths], ports)
    relay.start()
    try:
        pubs = [_publisher(context, p) for p in paths]
        subs = [_subscriber(context, port) for port in ports]
        for pub, sub in zip(pubs, subs, strict=True):
            _until_received(pub, sub)
        payload = bytes(range(256)) * 40  # binary, with every byte value
        for seq in range(500):
            for i, pub in enumerate(pubs):
                pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), bytes([i]) + payload])
        for i, sub in enumerate(subs):
            for seq in range(500):
                topic, number, body = sub.recv_multipart()
                assert (topic, int.from_bytes(number, "big")) == (b"kv-events", seq)
                assert body == bytes([i]) + payload, "stream i arrives on port i, unchanged"
        assert all(n >= 500 for n in relay.forwarded)
    finally:
        relay.stop()
    assert not any(p.exists() for p in paths), "the ipc paths are removed at stop"


def test_a_restarted_publisher_is_followed(one_stream: tuple[Path, int, KvEventRelay],
                                           context: zmq.Context[zmq.Socket[bytes]]) -> None:
    path, port, _ = one_stream
    sub = _subscriber(context, port)
    first = _publisher(context, path)
    _until_received(first, sub)
    first.close(0)
    path.unlink()  # as a killed instance leaves it; its successor binds the path again
    second = _publisher(context, path)
    _until_received(second, sub)
    second.send_multipart([b"kv-events", b"after", b"restart"])
    assert sub.recv_multipart() == [b"kv-events", b"after", b"restart"]


def test_no_subscriber_and_a_flood_never_block_the_relay(
        one_stream: tuple[Path, int, KvEventRelay],
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """With its router gone, a flood past the high-water mark: ZMQ drops what does not fit,
    the relay keeps reading, and a router that comes back gets new events at once."""
    path, port, relay = one_stream
    pub = _publisher(context, path)
    sub = _subscriber(context, port)
    _until_received(pub, sub)
    sub.close(0)  # the router went away
    for i in range(150_000):  # past the relay's high-water mark (100,000)
        pub.send_multipart([b"kv-events", i.to_bytes(8, "big"), b""])
    settled, last = 0, -1
    while settled < 5:  # until the count stops moving
        time.sleep(0.1)
        now = relay.forwarded[0]
        settled, last = (settled + 1 if now == last else 0), now
    assert relay.forwarded[0] >= 100_000, "the relay kept reading through the flood"
    back = _subscriber(context, port)
    _until_received(pub, back)
    started = time.monotonic()
    relay.stop()
    assert time.monotonic() - started < 5


def test_a_taken_port_fails_at_start_naming_it(tmp_path: Path,
                                               context: zmq.Context[zmq.Socket[bytes]]) -> None:
    holder = context.socket(zmq.PUB)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    relay = KvEventRelay([f"ipc://{tmp_path / 'a.kv'}"], [port])
    with pytest.raises(OSError, match=f"cannot listen on tcp://127.0.0.1:{port}"):
        relay.start()
    holder.close(0)


def test_the_instances_config_turns_events_on_at_the_path() -> None:
    import json

    from vllm.config import KVEventsConfig

    config = KVEventsConfig(**json.loads(instance_events_config("ipc:///run/x.kv")))
    assert config.enable_kv_cache_events and config.publisher == "zmq"
    assert config.endpoint == "ipc:///run/x.kv"
