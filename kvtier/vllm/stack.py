"""``kvtier serve --instances N``: the seed's stack on one machine.

::

    router (kvtier route | vllm-router)  :P          one OpenAI endpoint
      ├── instance 0: kvtier serve :P+1  node server :P+101 (own socket, arena)  ┐
      ├── instance 1: kvtier serve :P+2  node server :P+102                      ├─ one shared
      └── ...                                                                    ┘  tier

Each instance is a single-instance ``kvtier serve`` child (vLLM plus the node server it hosts,
as if on a node of its own), bound to a core of its own on the CPU build
(``VLLM_CPU_OMP_THREADS_BIND=i``), logging to ``RUN_DIR/instance-i.log``. The router starts
once every instance answers. One Ctrl-C (or SIGTERM) stops the router, then the instances
(each by its process id, then whatever is left in its process group), then any local
service started for ``--shared-local``. ``RUN_DIR/stack.json`` lists every URL, for ``kvtier
verify --stack``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import ServerConfig, runtime_dir
from kvtier.errors import KvtierError
from kvtier.ports import check_plan
from kvtier.vllm.children import Child, stop_all
from kvtier.vllm.front import router_argv
from kvtier.vllm.stack_options import StackOptions, cores
from kvtier.vllm.summary import say, tiers_line

READY_TIMEOUT_S = 900.0


def run_stack(args: argparse.Namespace) -> int:
    from kvtier.vllm.serve import default_sizes

    try:
        options = StackOptions.from_args(args, default_sizes()[0])
    except KvtierError as exc:
        print(f"kvtier serve: {exc}", file=sys.stderr)
        return 2
    stack = Stack(options)
    if args.dry_run:
        for i in range(options.instances):
            print(shlex.join(stack.instance_argv(i)))
        return 0
    return stack.run()


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.o = options
        self.stop = threading.Event()
        self.instances: list[Child] = []
        self.router: Child | None = None
        self.shared: dict[str, Any] | None = None
        self.env: dict[str, str] = {}
        self.services = ExitStack()

    # ------------------------------------------------------------------ plan

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.o.instance_port(i)}"

    def node_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.o.node_port(i)}"

    @property
    def router_url(self) -> str | None:
        if self.o.router == "none":
            return None
        host = "127.0.0.1" if self.o.host in ("0.0.0.0", "::", "") else self.o.host
        return f"http://{host}:{self.o.port}"

    def server_config(self, i: int) -> dict[str, Any]:
        """Instance i's node server; its token comes from ``--node-token-file``, else from
        ``$KVTIER_NODE_TOKEN`` in the environment it inherits (the default of ``auth``)."""
        config: dict[str, Any] = {
            "socket_path": os.path.join(runtime_dir(), f"stack-{os.getpid()}-{i}.sock"),
            "arena": {"size_bytes": self.o.arena_bytes},
            "tiers": [self.shared] if self.shared else [],
            "metrics_port": self.o.node_port(i), "metrics_host": "127.0.0.1"}
        if self.o.node_token_file:
            config["auth"] = {"http_token_file": self.o.node_token_file}
        return config

    def instance_argv(self, i: int) -> list[str]:
        o = self.o
        argv = [sys.executable, "-m", "kvtier", "serve", "--server-config",
                str(o.run_dir / f"instance-{i}.yaml"), "--log-file", "-",
                "--chunk-tokens", str(o.chunk_tokens), "--priority", str(o.priority)]
        if o.model:
            argv += ["--model", o.model]
        return [*argv, "--port", str(o.instance_port(i)), "--host", "127.0.0.1",
                *o.vllm_args]

    def instance_env(self, i: int) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if _is_cpu_build() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(i % cores())  # one core per instance
        return env

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        previous = {s: signal.signal(s, lambda *_: self.stop.set())
                    for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if not self._start():
                return 1
            self._say_status()
            return self._verify() if self.o.verify else self._watch()
        except KvtierError as exc:
            say(f"kvtier serve: {exc}")
            return 2
        finally:
            self._teardown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> bool:
        o = self.o
        self._check_ports()
        o.run_dir.mkdir(parents=True, exist_ok=True)
        self.shared = self._shared_tier()
        for i in range(o.instances):
            config = self.server_config(i)
            ServerConfig.from_dict(config)  # fail here, not in a child
            (o.run_dir / f"instance-{i}.yaml").write_text(yaml.safe_dump(config))
        say(f"kvtier serve: starting {o.instances} instance(s); logs in {o.run_dir}")
        for i in range(o.instances):
            log = o.run_dir / f"instance-{i}.log"
            log.unlink(missing_ok=True)
            self.instances.append(Child.start(f"instance {i}", self.instance_argv(i), log,
                                              self.instance_env(i)))
        if not self._wait_instances():
            return False
        return self._start_router()

    def _check_ports(self) -> None:
        """Every port free before anything starts (a ConfigError naming the first taken)."""
        o = self.o
        if o.router != "none":
            host = "0.0.0.0" if o.host in ("", "::") else o.host
            check_plan({f"the {o.router} router": o.port}, host)
        check_plan(o.instance_ports())

    def _shared_tier(self) -> dict[str, Any] | None:
        if self.o.shared_local is None:
            return self.o.shared_tier()
        from kvtier.vllm.local_shared import start_local_shared

        spec, env = start_local_shared(self.o.shared_local, self.o.run_dir, self.services)
        self.env.update(env)
        return self.o.shared_tier(spec)

    def _wait_instances(self) -> bool:
        started = time.monotonic()
        pending = dict(enumerate(self.instances))
        deadline = started + READY_TIMEOUT_S
        while pending and not self.stop.is_set() and time.monotonic() < deadline:
            for i, child in list(pending.items()):
                if not child.running:
                    self._say_died(child)
                    return False
                if _answers(self.url(i)):
                    say(f"  instance {i} up in {time.monotonic() - started:.0f} s")
                    del pending[i]
            time.sleep(0.5)
        if pending and not self.stop.is_set():
            say(f"kvtier serve: instance(s) {sorted(pending)} not up after "
                f"{READY_TIMEOUT_S:.0f} s")
        return not pending

    def _start_router(self) -> bool:
        o = self.o
        argv = router_argv(o.router, o.policy, o.host, o.port,
                           [self.url(i) for i in range(o.instances)],
                           [self.node_url(i) for i in range(o.instances)],
                           o.run_dir / "router-install.log", node_token_file=o.node_token_file)
        if argv is None or self.stop.is_set():
            return not self.stop.is_set()
        log = o.run_dir / "router.log"
        log.unlink(missing_ok=True)
        # the environment goes with it: kvtier route reads $KVTIER_NODE_TOKEN by default
        self.router = Child.start(f"router ({o.router})", argv, log)
        deadline = time.monotonic() + 120
        url = self.router_url or ""
        while not self.stop.is_set() and time.monotonic() < deadline:
            if not self.router.running:
                self._say_died(self.router)
                return False
            if _answers(url):
                return True
            time.sleep(0.3)
        if not self.stop.is_set():
            say(f"kvtier serve: the router did not answer at {url}; see {log}")
        return False

    def _watch(self) -> int:
        self._write_state()
        while not self.stop.wait(0.5):
            for child in [*self.instances, *([self.router] if self.router else [])]:
                if not child.running:
                    self._say_died(child)
                    return 1
        return 0

    def _verify(self) -> int:
        from kvtier.verify.run import VerifyOptions, verify

        self._write_state()
        options = VerifyOptions.from_stack(self.state(), node_token=self.o.node_token())
        return verify(options)

    def _teardown(self) -> None:
        if self.router is not None:
            stop_all([self.router], 30)
        if self.instances:
            say(f"kvtier serve: stopping {len(self.instances)} instance(s)")
            stop_all(self.instances, 90)
        self.services.close()
        say("kvtier serve: stopped")

    # ------------------------------------------------------------------ reporting

    def state(self) -> dict[str, Any]:
        return {
            "router": {"kind": self.o.router, "policy": self.o.policy, "url": self.router_url,
                       "pid": self.router.pid if self.router else None},
            "instances": [{"url": self.url(i), "node": self.node_url(i), "pid": c.pid,
                           "log": str(c.log)} for i, c in enumerate(self.instances)],
            "shared": self.shared,
            "node_token": self.o.node_token_source(),  # where from, never the token
        }

    def _write_state(self) -> Path:
        path = self.o.run_dir / "stack.json"
        path.write_text(json.dumps(self.state(), indent=2))
        return path

    def _say_status(self) -> None:
        o = self.o
        front = (f"{o.router} ({o.policy}) at {self.router_url}/v1" if self.router_url
                 else "no router: call the instances directly")
        say(f"kvtier serve: {o.instances} instance(s) up; {front}")
        bind = _is_cpu_build() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
        for i in range(o.instances):
            core = f"  core {i % cores()}" if bind else ""
            say(f"  instance {i}  {self.url(i)}/v1  node server {self.node_url(i)}{core}")
        tiers = ServerConfig.from_dict({**self.server_config(0), "metrics_port": None})
        say(f"  tiers of each instance: {tiers_line(tiers)}"
            + ("" if self.shared else " (no shared tier)"))
        token = o.node_token_source()
        if token:
            where = token.get("file") or f"${token.get('env')}"
            say(f"  node servers' /v1/* need the bearer token in {where}")
        say(f"  check it: kvtier verify --stack {o.run_dir / 'stack.json'}")
        say("  Ctrl-C stops everything.")

    def _say_died(self, child: Child) -> None:
        say(f"kvtier serve: {child.name} exited (status {child.popen.returncode}); the end "
            f"of {child.log}:\n{child.tail()}")


def _answers(url: str) -> bool:
    from kvtier.httpjson import HttpError, request

    try:
        request(f"{url}/v1/models", timeout_s=3)
        return True
    except HttpError:
        return False


def _is_cpu_build() -> bool:
    from kvtier.vllm.serve import is_cpu_build

    return is_cpu_build()
