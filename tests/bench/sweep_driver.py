"""``python sweep_driver.py ARGS...``: ``kvtier bench sweep ARGS...`` in a process of its own,
with stub configurations that start ``stub_server.py`` (real HTTP servers, no vLLM), so a
test can kill the sweep as a user's machine would."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.bench.stacks import StackEnv, StartedConfig, engine, free_port, launch, register_stack
from kvtier.cli import main

STUB = str(Path(__file__).with_name("stub_server.py"))
CONFIGS = ("stub-a", "stub-b")


def _start(env: StackEnv) -> StartedConfig:
    port = free_port()
    return launch(env, [engine("stub", [sys.executable, STUB, "--port", str(port)], port)],
                  port)


if __name__ == "__main__":
    for name in CONFIGS:
        register_stack(name, f"stub stack {name}", _start)
    sys.exit(main(["bench", "sweep", *sys.argv[1:]]))
