"""Ports: distinct free ones, a stack's derived ports checked before anything starts, and
``--instances`` bounded so instance and node-server ports never collide or pass 65535."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.launch.stack_options import StackOptions
from kvtier.ports import (
    MAX_PORT,
    check_plan,
    ephemeral_range,
    free_base,
    free_ports,
    port_free,
    wait_bindable,
)
from kvtier.ports import (
    listening as a_server_listens,
)

GiB = 1 << 30


@contextmanager
def listening(port: int = 0) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen(1)
        yield int(s.getsockname()[1])


def parse(*argv: str) -> argparse.Namespace:
    from kvtier.launch.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def options(tmp_path: Path, *argv: str) -> StackOptions:
    return StackOptions.from_args(parse("--router", "none", "--shared", str(tmp_path / "s"),
                                        "--run-dir", str(tmp_path / "run"), *argv), 4 * GiB)


def test_ports_picked_together_are_distinct_and_free() -> None:
    for _ in range(20):
        picked = free_ports(3)
        assert len(set(picked)) == 3
        assert all(port_free(p) for p in picked)
    with listening() as taken:
        assert not port_free(taken)


def test_a_base_port_has_every_derived_port_free() -> None:
    base = free_base((0, 1, 2, 101, 102))
    assert base + 102 <= MAX_PORT
    assert all(port_free(base + k) for k in (0, 1, 2, 101, 102))


def test_a_plan_names_the_port_in_use_or_out_of_range() -> None:
    with listening() as taken, pytest.raises(ConfigError) as info:
        check_plan({"instance 0": free_ports(1)[0], "instance 1's node server": taken})
    assert f"port {taken} (instance 1's node server) is in use" in str(info.value)
    with pytest.raises(ConfigError, match=r"port 65536 \(instance 0\) is out of range"):
        check_plan({"instance 0": 65536})


def test_more_than_100_instances_are_refused(tmp_path: Path) -> None:
    assert options(tmp_path, "--instances", "100").node_port(99) == 8000 + 101 + 99
    with pytest.raises(ConfigError, match="--instances: at most 100, got 101"):
        options(tmp_path, "--instances", "101")


def test_a_port_whose_node_servers_pass_65535_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="would listen on 65537, above 65535"):
        options(tmp_path, "--instances", "2", "--", "--port", "65435")
    assert options(tmp_path, "--instances", "2", "--", "--port", "65433").node_port(1) == MAX_PORT


def test_the_stack_refuses_to_start_when_a_derived_port_is_taken(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.launch.stack import Stack

    base = free_base((0, 1, 2, 101, 102))
    with listening(base + 102):  # instance 1's node server's port
        o = options(tmp_path, "--instances", "2", "--", "--port", str(base))
        assert o.instance_ports() == {"instance 0": base + 1,
                                      "instance 0's node server": base + 101,
                                      "instance 1": base + 2,
                                      "instance 1's node server": base + 102}
        stack = Stack(o)
        assert stack.run() == 2
    out = capsys.readouterr().out
    assert f"port {base + 102} (instance 1's node server) is in use" in out
    assert stack.instances == [] and "starting" not in out, "nothing was started"


def _time_wait_port() -> tuple[int, socket.socket]:
    """A port held only by an outgoing connection that closed first (TIME_WAIT): no server
    could bind it now, SO_REUSEADDR or not. Returns it and the listener (keep it open)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.socket()
    client.bind(("127.0.0.1", 0))
    port = int(client.getsockname()[1])
    client.connect(listener.getsockname())
    accepted, _ = listener.accept()
    client.close()  # the side that closes first keeps the port in TIME_WAIT
    accepted.close()
    return port, listener


def test_a_port_held_by_a_closed_connection_is_not_listening_and_is_waited_for() -> None:
    port, listener = _time_wait_port()
    try:
        assert not port_free(port)
        assert not a_server_listens(port), "only connections hold it"
        with pytest.raises(ConfigError, match=r"stayed in use by connections .* below"):
            wait_bindable(port, "a restarted part", timeout_s=1.0)
    finally:
        listener.close()


def test_a_port_a_server_listens_on_fails_at_once_naming_it() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        assert a_server_listens(port)
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"port {port} \(the node server\) is in use"):
            wait_bindable(port, "the node server", timeout_s=30.0)
        assert time.monotonic() - start < 5, "a listener is not waited for"


def test_a_free_port_is_bindable_at_once() -> None:
    port = free_ports(1)[0]
    wait_bindable(port, "a part", timeout_s=0.5)
    low, high = ephemeral_range()
    assert 1 <= low <= high <= MAX_PORT


def test_a_base_and_its_derived_ports_stay_outside_the_ephemeral_range() -> None:
    low, high = ephemeral_range()
    for _ in range(20):
        base = free_base((0, 1, 2, 101, 102))
        assert not any(low <= base + k <= high for k in (0, 1, 2, 101, 102))
