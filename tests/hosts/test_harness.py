"""The harness itself: hosts reach each other, nothing else reaches them, nothing is left."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from hosts.netns import ETC_NETNS, Network, ip, namespaces, ns_pids, sweep_stale, wait_for


def listen(address: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((address, 0))
    sock.listen(4)
    sock.settimeout(5.0)
    return sock


def exchange(address: str, port: int) -> bytes:
    with socket.create_connection((address, port), timeout=5.0) as conn:
        conn.sendall(b"ping")
        return conn.recv(16)


def connect_error(address: str, port: int) -> str:
    """The error a connection attempt ends in (bounded by a 2 s timeout)."""
    try:
        with socket.create_connection((address, port), timeout=2.0):
            return "connected"
    except OSError as exc:
        return type(exc).__name__ + f" {exc.errno}"


def test_two_hosts_reach_each_other_and_nothing_else_does(network: Network) -> None:
    a, b = network.add_host(), network.add_host()
    outside = network.add_isolated()
    server = a.call(listen, a.address)
    port = server.getsockname()[1]
    try:
        answer = b.call(lambda: _serve_once(server, lambda: exchange(a.address, port)))
        assert answer == b"ping"
        # a namespace on no switch has no route to the hosts
        assert outside.call(connect_error, a.address, port).startswith("OSError 101"), \
            "a namespace outside the switch reached a host"
    finally:
        server.close()
    # the root namespace holds none of the test's links, addresses or routes
    root_links = ip("-o", "link")
    root_addrs = ip("-o", "addr")
    assert network.subnet + "." not in root_addrs
    assert network.subnet + "." not in ip("route")
    root_names = {line.split(": ")[1].split("@")[0] for line in root_links.splitlines()}
    assert not root_names & {"br0", "p1", "p2"}, root_names
    route = ip("route", "get", a.address, check=False)
    assert "dev p" not in route and "dev br0" not in route, route
    # each host sees only its own address and the subnet route
    assert ip("-n", a.name, "-o", "-4", "addr").count("inet ") == 2  # lo + eth0
    assert f"{network.subnet}.0/24 dev eth0" in ip("-n", a.name, "route")


def _serve_once(server: socket.socket, client: object) -> bytes:
    """Accept one connection on ``server`` while ``client()`` runs (in this thread's host)."""
    import threading
    got: list[bytes] = []

    def accept() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(16))

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    got.append(client())  # type: ignore[operator]
    thread.join(5.0)
    return got[0]


def test_processes_run_inside_a_host_and_close_removes_everything(
        make_network: object, tmp_path: Path) -> None:
    network = make_network()  # type: ignore[operator]
    host = network.add_host()
    log = tmp_path / "sleep.log"
    code = "import socket,time; s=socket.socket(); s.bind(('0.0.0.0', 0)); " \
           "print(open('/proc/net/route').read(), flush=True); time.sleep(60)"
    popen = host.spawn([sys.executable, "-c", code], log=log)
    wait_for(lambda: "eth0" in log.read_text(), timeout_s=10, what="child's output",
             popen=popen, log=log)
    assert popen.pid in ns_pids(host.name)
    names = network.names()
    started = time.monotonic()
    network.close()
    assert time.monotonic() - started < 15
    assert popen.poll() is not None, "a process of a host outlived close()"
    assert not set(names) & set(namespaces())
    assert not [line for line in ip("-o", "link").splitlines() if "veth" in line]


def test_stale_namespaces_of_a_dead_run_are_swept(can_make_hosts: None) -> None:
    dead = _dead_pid()
    name = f"kvh-{dead}-0-h1"
    ip("netns", "add", name)
    (ETC_NETNS / name).mkdir(parents=True)  # the hosts file a killed run left
    try:
        assert name in sweep_stale()
        assert name not in namespaces()
        assert not (ETC_NETNS / name).exists()
    finally:
        ip("netns", "del", name, check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    mine = f"kvh-{os.getpid()}-99-h1"
    ip("netns", "add", mine)
    try:
        assert mine not in sweep_stale(), "a live run's namespace was swept"
    finally:
        ip("netns", "del", mine, check=False)


def _dead_pid() -> int:
    import subprocess
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("hosts", [3])
def test_hosts_get_distinct_addresses(network: Network, hosts: int) -> None:
    made = [network.add_host() for _ in range(hosts)]
    assert len({h.address for h in made}) == hosts
    assert all(h.address.startswith(network.subnet + ".") for h in made)


def test_a_hosts_own_resolver_answers_its_names_and_goes_with_the_network(
        make_network: object) -> None:
    network = make_network()  # type: ignore[operator]
    host, other = network.add_host(), network.add_host()
    host.hosts_file({"fleet.kvh.test": [host.address, other.address]})
    answer = host.run(["getent", "ahostsv4", "fleet.kvh.test"]).stdout
    assert {line.split()[0] for line in answer.splitlines()} == {host.address, other.address}
    assert host.run(["getent", "hosts", "fleet.kvh.test"]).returncode == 0
    assert other.run(["getent", "hosts", "fleet.kvh.test"]).returncode == 2, \
        "another host's resolver answered the name"
    assert not Path("/etc/hosts").read_text().count("fleet.kvh.test")
    folder = ETC_NETNS / host.name
    network.close()
    assert not folder.exists(), "the host's hosts file outlived the network"
