"""Fixtures of the multi-host tests: a network of namespaces per test, torn down in any case.

At the session's start the namespaces that killed test runs left (``kvh-PID-*`` of a PID that
is gone) are removed; when this process exits without running the finalizers, ``atexit``
closes what is still open (:func:`hosts.netns.close_all`); a SIGKILL leaves them to the next
sweep (the processes in them die with this one: they are started with a parent-death signal).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hosts.netns import Network, sweep_stale, unavailable


@pytest.fixture(scope="session")
def can_make_hosts() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"no hosts of their own here: {why}")
    sweep_stale()


@pytest.fixture
def make_network(can_make_hosts: None) -> Iterator[Callable[[], Network]]:
    made: list[Network] = []

    def make() -> Network:
        network = Network()
        made.append(network)
        return network

    yield make
    for network in made:
        network.close()


@pytest.fixture
def network(make_network: Callable[[], Network]) -> Network:
    return make_network()
