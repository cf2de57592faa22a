"""kvtier's tiers in vLLM's KV-event stream, end to end (vLLM CPU build, real ZMQ).

A vLLM engine with ``kv_events_config`` (publisher ``zmq``, connecting to a subscriber this
test binds on loopback) and the kvtier connector on a node server with a tiny arena (8
chunks) and a disk tier. Prompt A is stored; B and C push it out of the arena. The subscriber
decodes vLLM's msgpack event batches: kvtier's ``BlockStored`` (medium CPU) carry the very
block hashes vLLM announces for its own device cache (medium GPU) for A; the disk tier's
carry them with medium STORAGE; after the eviction a ``BlockRemoved`` (CPU) takes A's blocks
back. Every decoded event is written to ``kv-events.jsonl`` in the test's folder and a
summary is printed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import e2e
import pytest
from e2e import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SLOT = 4096 + (1 << 20)  # one chunk of the demo model in float32
A, B, C = e2e.prompts([1024, 1024, 1024], seed=21)
TAIL = e2e.prompts([300], seed=22)[0]


@dataclass
class Subscriber:
    """A ZMQ SUB socket bound on loopback, decoding vLLM's event batches in a thread."""

    port: int = 0
    batches: list[Any] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Subscriber:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            if self._sock.poll(100):
                _topic, seq, payload = self._sock.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))

    def events(self) -> list[Any]:
        return [e for _, batch in list(self.batches) for e in batch.events]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, demo_model: str) -> Iterator[dict[str, Any]]:
    from vllm import LLM
    from vllm.config import KVEventsConfig

    root = tmp_path_factory.mktemp("kv-events")
    node = ServerProcess(root / "node", arena_bytes=8 * SLOT).start()
    sub = Subscriber().start()
    args = e2e.engine_args(node.socket_path, kv_events_interval_s=0.1)
    llm = LLM(model=demo_model, **args, kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{sub.port}", topic="kv"))
    try:
        for prompt in (A, B, C):
            e2e.generate(llm, [prompt])
        time.sleep(1.0)  # the disk tier's writes finish; the next step publishes them
        e2e.generate(llm, [TAIL])
        time.sleep(0.5)
        yield {"events": sub.events(), "batches": len(sub.batches), "root": root}
    finally:
        e2e.close_llm(llm)
        sub.stop()
        node.stop()


def _hashes(events: list[Any], kind: str, medium: str) -> list[int]:
    return [h for e in events if type(e).__name__ == kind and e.medium == medium
            for h in e.block_hashes]


def _record(run: dict[str, Any]) -> Path:
    """Every decoded event as one JSON line, and a summary on the test's output."""
    out = run["root"] / "kv-events.jsonl"
    counts: dict[str, int] = {}
    with open(out, "w") as f:
        for e in run["events"]:
            doc = {"type": type(e).__name__, **{k: getattr(e, k) for k in e.__struct_fields__}}
            if "token_ids" in doc:
                doc["token_ids"] = f"{len(doc['token_ids'])} tokens"
            f.write(json.dumps(doc) + "\n")
            name = f"{doc['type']}/{doc.get('medium')}/{doc.get('ownership')}"
            counts[name] = counts.get(name, 0) + 1
    print(f"\nKV events ({run['batches']} batches) written to {out}:")
    for name, n in sorted(counts.items()):
        print(f"  {n:4d}  {name}")
    return out


def test_kvtier_blocks_carry_the_hashes_vllm_gives_its_own(run: dict[str, Any]) -> None:
    events = run["events"]
    _record(run)
    gpu = _hashes(events, "BlockStored", "GPU")
    cpu = [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "CPU"]
    a_blocks = len(A) // 128
    a_hashes = gpu[:a_blocks]  # vLLM's own announcement of A's prompt blocks comes first
    first = [e for e in cpu if e.token_ids == A[: len(e.token_ids)]]
    assert first, "no CPU BlockStored for prompt A's first chunk"
    mine = [e for e in cpu if e.block_hashes[0] in a_hashes]
    assert sorted(h for e in mine for h in e.block_hashes) == sorted(a_hashes)
    for e in mine:
        i = a_hashes.index(e.block_hashes[0])
        assert e.block_size == 128 and e.token_ids == A[i * 128:(i + 2) * 128]
        assert e.parent_block_hash == (a_hashes[i - 1] if i else None)
        assert (e.locality, e.ownership) == ("LOCAL", None)


def test_the_disk_tier_is_announced_as_storage(run: dict[str, Any]) -> None:
    events = run["events"]
    a_hashes = _hashes(events, "BlockStored", "GPU")[: len(A) // 128]
    disk = [e for e in events if type(e).__name__ == "BlockStored"
            and e.medium == "STORAGE" and e.ownership == "disk"]
    assert set(a_hashes) <= {h for e in disk for h in e.block_hashes}
    assert {e.locality for e in disk} == {"LOCAL"}


def test_eviction_from_the_arena_takes_the_blocks_back(run: dict[str, Any]) -> None:
    events = run["events"]
    a_hashes = _hashes(events, "BlockStored", "GPU")[: len(A) // 128]
    gone = _hashes(events, "BlockRemoved", "CPU")
    assert set(a_hashes) <= set(gone), "A left the 8-chunk arena: its blocks are removed"
    assert _hashes(events, "BlockRemoved", "STORAGE") == [], "the disk tier still holds A"
    last_stored = max(i for i, e in enumerate(events) if type(e).__name__ == "BlockStored"
                      and e.medium == "CPU" and e.block_hashes[0] in a_hashes)
    first_removed = min(i for i, e in enumerate(events) if type(e).__name__ == "BlockRemoved"
                        and e.medium == "CPU" and set(e.block_hashes) & set(a_hashes))
    assert last_stored < first_removed
