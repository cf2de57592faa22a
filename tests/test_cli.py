"""`kvtier server --config FILE` as a real process: serves, then shuts down gracefully."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import KvtierClient
from kvtier.errors import ServerUnavailable
from kvtier.keys import chunk_keys
from kvtier.tiers.arena import shm_path

NS = b"\x07" * 32


def _wait_for_socket(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else b""
            raise AssertionError(f"server exited early: {err!r}")
        time.sleep(0.05)
    raise AssertionError("server socket never appeared")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    name = f"kvtier-cli-{os.getpid()}"
    path = tmp_path / "server.yaml"
    path.write_text(
        f"socket_path: {tmp_path / 'run' / 'kvtier.sock'}\n"
        f"arena: {{size_bytes: 4MiB, slot_bytes: 16KiB, name: {name}}}\n"
        "tiers:\n"
        f"  - {{type: disk, capacity_bytes: 8MiB, options: {{path: {tmp_path / 'disk'}}}}}\n"
        "log_format: text\n"
    )
    return path


def test_server_process_serves_and_stops_on_sigterm(config_file: Path, tmp_path: Path) -> None:
    sock = tmp_path / "run" / "kvtier.sock"
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "server", "--config",
                             str(config_file)], stderr=subprocess.PIPE)
    try:
        _wait_for_socket(sock, proc)
        assert (sock.stat().st_mode & 0o777) == 0o600
        client = KvtierClient(str(sock))
        keys = chunk_keys(NS, np.arange(512, dtype=np.int32), 256)
        slots = client.reserve(NS, keys, payload_len=8192, tokens=256)
        assert all(s is not None for s in slots)
        client.payload_view(slots[0], 8192)[:] = 42
        assert client.commit(keys) == 2
        assert client.lookup(keys) == ["arena", "arena"]
        arena = client.connect().arena_name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        client.close()
        with pytest.raises(ServerUnavailable):
            client.lookup(keys)
        assert not sock.exists()
        assert not os.path.exists(shm_path(arena))
        # write-through finished before exit: both chunks are on disk
        assert len(list((tmp_path / "disk" / "chunks").rglob("*.kvc"))) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_bad_config_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("arena: {size_bytes: 4MiB, slot_byte: 16KiB}\n")
    out = subprocess.run([sys.executable, "-m", "kvtier", "server", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "arena.slot_byte: unknown key" in out.stderr
    assert "slot_bytes" in out.stderr
