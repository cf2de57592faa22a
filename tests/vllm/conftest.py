"""Fixtures for the vLLM integration tests.

The end-to-end modules share one demo model and one baseline: the greedy tokens of every
prompt set, generated once per session by an engine *without* kvtier.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

VLLM = importlib.util.find_spec("vllm") is not None
# vLLM sets torch's thread count for the first engine of a process and exports it to later
# ones; fixing it here gives every engine (baseline and kvtier) the same kernels.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install 'kvtier[vllm]')")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cluster_secret() -> Iterator[None]:
    """The end-to-end tests run with a cluster secret (docs/security.md): every chunk on a
    shared tier is sealed with a MAC and checked on every read, and tokens must still equal a
    run without kvtier. Every node server they start (in-process or ``kvtier server``) reads
    it. Set for the tests of this folder only (it would change what other tests expect of
    notes), from the first of them to the end of the session, then restored."""
    before = os.environ.get("KVTIER_SHARED_SECRET")
    os.environ["KVTIER_SHARED_SECRET"] = "kvtier end-to-end cluster secret"
    yield
    if before is None:
        del os.environ["KVTIER_SHARED_SECRET"]
    else:
        os.environ["KVTIER_SHARED_SECRET"] = before


@pytest.fixture(scope="session")
def vllm_router(tmp_path_factory: pytest.TempPathFactory) -> str:
    """vllm-router for the stacks behind it, installed here as the benchmarks install their
    peers (``kvtier serve`` never installs it); given to them with ``--vllm-router``."""
    from kvtier.bench.peers import ensure_vllm_router

    log = tmp_path_factory.mktemp("vllm-router") / "install.log"
    return str(ensure_vllm_router(log_file=log))


@pytest.fixture(scope="session")
def demo_model() -> str:
    from kvtier.demo import ensure_demo_model

    return str(ensure_demo_model())


BASELINE_SETS = {"LONG": 8, "PREEMPT": 200, "SHARED_1": 8, "SHARED_2": 8, "ABORTED": 8}


@pytest.fixture(scope="session")
def baseline(demo_model: str) -> Iterator[dict[str, list[list[int]]]]:
    """Tokens of each prompt set from an engine without kvtier (one prompt at a time)."""
    import e2e

    llm = e2e.make_llm(demo_model, None)
    try:
        yield_value = {
            name: e2e.one_by_one(llm, getattr(e2e, name), max_tokens).tokens
            for name, max_tokens in BASELINE_SETS.items()
        }
        for backend, batch in e2e.CROSS.items():
            yield_value[f"CROSS_{backend}"] = e2e.one_by_one(llm, batch, 8).tokens
    finally:
        e2e.close_llm(llm)
    yield yield_value


@pytest.fixture
def engines(make_server: Any) -> Iterator[Any]:
    """``engines(server, **kw)``: a scheduler+worker pair without vLLM, closed at the end."""
    from rig import FakeEngine

    made: list[Any] = []

    def make(server: Any, **kw: Any) -> Any:
        engine = FakeEngine(server.socket_path, **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()
