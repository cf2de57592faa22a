"""``kvtier serve --instances N``: the seed's stack on one machine.

::

    router (kvtier route | vllm-router)  :P          one OpenAI endpoint
      ├── instance 0: kvtier serve :P+1  node server :P+101 (own socket, arena)  ┐
      ├── instance 1: kvtier serve :P+2  node server :P+102                      ├─ one shared
      └── ...                                                                    ┘  tier

Each instance is a single-instance ``kvtier serve`` child (vLLM plus the node server it hosts,
as if on a node of its own), bound to a core of its own on the CPU build
(``VLLM_CPU_OMP_THREADS_BIND`` and the CPU affinity of all its processes), logging to
``RUN_DIR/instance-i.log``. The router starts once every instance answers (or was given up
on). Every part — instance, router, local service — is supervised
(:mod:`kvtier.launch.supervise`): one that exits or stops answering is restarted alone, with
backoff, until it fails too often and is given up; the rest keeps serving. A router given up
on before it ever answered stops the stack (exit status 1): it never had an endpoint. One
Ctrl-C (or SIGTERM) stops the router, then the instances (each by its process id, then
whatever is left in its process groups), then any local service started for
``--shared-local``.
``RUN_DIR/stack.json`` lists every URL and every part's state, for ``kvtier verify --stack``
and the router's ``/metrics``. With vllm-router's ``kv_aware`` the instances publish KV events,
relayed on 127.0.0.1 by a thread of this process (:mod:`kvtier.launch.kv_events`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from kvtier.config import ServerConfig, runtime_dir
from kvtier.demo.model import DEMO_NAME
from kvtier.errors import KvtierError
from kvtier.launch.front import KvEventSources, router_argv
from kvtier.launch.kv_events import KvEventRelay, instance_events_config, relay_endpoint
from kvtier.launch.parts import ProcessPart, ServicePart, stop_together
from kvtier.launch.plan import default_sizes, instance_binding, instance_cpu, is_cpu_build
from kvtier.launch.sizing import flag_value
from kvtier.launch.stack_options import StackOptions
from kvtier.launch.summary import say, tiers_line
from kvtier.launch.supervise import PartState, Supervised, Supervisor
from kvtier.ports import check_plan, ephemeral_range
from kvtier.processes import StopRequest

GAVE_UP_STATUS = 3
"""Exit status of a stack stopped (Ctrl-C) after it gave up on a part; its last line names
the part. A stack that stops itself (every instance given up, or ``--restart never``) exits 1.
"""


def run_stack(args: argparse.Namespace) -> int:
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
        self.stop = StopRequest()
        self.instances: list[ProcessPart] = []
        self.router: ProcessPart | None = None
        self.shared: dict[str, Any] | None = None
        self.env: dict[str, str] = {}
        self.services = ExitStack()
        self.relay: KvEventRelay | None = None
        self.supervisor = Supervisor(options.restart, say, self._changed)
        self.announced = False

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

    def kv_event_endpoint(self, i: int) -> str:
        """The ipc endpoint instance i publishes its KV events on (kv_aware only)."""
        return "ipc://" + os.path.join(runtime_dir(), f"stack-{os.getpid()}-{i}.kv-events")

    def kv_event_sources(self) -> KvEventSources:
        """What vllm-router's kv_aware is told: the relayed streams, the engines' block size
        (``--block-size``, else vLLM's default: 128 on the CPU build, 16 elsewhere) and the
        served model's name (as each instance's ``kvtier serve`` names it: ``--served-model-name``,
        else ``--model``, else the demo model's name)."""
        o = self.o
        block = flag_value(o.vllm_args, "--block-size") or (128 if is_cpu_build() else 16)
        model = flag_value(o.vllm_args, "--served-model-name") or o.model or DEMO_NAME
        return KvEventSources(
            tuple(relay_endpoint(o.kv_event_port(i)) for i in range(o.instances)),
            int(block), model)

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
        if o.kv_events:
            argv += ["--kv-events-config", instance_events_config(self.kv_event_endpoint(i))]
        return [*argv, "--port", str(o.instance_port(i)), "--host", "127.0.0.1",
                *o.vllm_args]

    def instance_env(self, i: int) -> dict[str, str]:
        return {**os.environ, **self.env, **instance_binding(i)[0]}

    def instance_part(self, i: int) -> ProcessPart:
        """vLLM's /health must say 200: it says 503 once its EngineCore died. On the CPU
        build the whole instance runs on its core (:func:`instance_binding`)."""
        return ProcessPart(f"instance {i}", self.instance_argv(i),
                           self.o.run_dir / f"instance-{i}.log", f"{self.url(i)}/health",
                           env=self.instance_env(i), cpus=instance_binding(i)[1])

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        with self.stop:
            try:
                self._start()
                return self._supervise()
            except KvtierError as exc:
                say(f"kvtier serve: {exc}")
                return 2
            finally:
                self._teardown()

    def _start(self) -> None:
        o = self.o
        self._check_ports()
        o.run_dir.mkdir(parents=True, exist_ok=True)
        self.shared = self._shared_tier()
        for i in range(o.instances):
            config = self.server_config(i)
            ServerConfig.from_dict(config)  # fail here, not in a child
            (o.run_dir / f"instance-{i}.yaml").write_text(yaml.safe_dump(config))
        if o.kv_events:  # listening before the instances publish, or a taken port fails now
            self.relay = KvEventRelay([self.kv_event_endpoint(i) for i in range(o.instances)],
                                      [o.kv_event_port(i) for i in range(o.instances)])
            try:
                self.relay.start()
            except OSError as exc:
                raise KvtierError(str(exc)) from exc
        say(f"kvtier serve: starting {o.instances} instance(s); logs in {o.run_dir}")
        for i in range(o.instances):
            (o.run_dir / f"instance-{i}.log").unlink(missing_ok=True)
            part = self.instance_part(i)
            self.instances.append(part)
            self.supervisor.add(part)

    def _check_ports(self) -> None:
        """Every port free before anything starts (a ConfigError naming the first taken)."""
        o = self.o
        if o.router != "none":
            host = "0.0.0.0" if o.host in ("", "::") else o.host
            check_plan({f"the {o.router} router": o.port}, host)
        check_plan(o.instance_ports())
        low, high = ephemeral_range()
        inside = sorted(p for p in [o.port, *o.instance_ports().values()] if low <= p <= high)
        if inside:
            say(f"kvtier serve: ports {inside[0]}-{inside[-1]} are in the kernel's ephemeral "
                f"range ({low}-{high}): a restarted part may wait up to a minute for its port "
                "(a closed outgoing connection holds it); a --port below "
                f"{low - 200} avoids that")

    def _shared_tier(self) -> dict[str, Any] | None:
        if self.o.shared_local is None:
            return self.o.shared_tier()
        from kvtier.launch.local_shared import start_local_shared

        spec, env, service = start_local_shared(self.o.shared_local, self.o.run_dir,
                                                self.services)
        self.env.update(env)
        self.supervisor.add(ServicePart(service.kind, service), launched=True, up=True)
        return self.o.shared_tier(spec)

    def _supervise(self) -> int:
        while not self.stop.requested:
            self.supervisor.tick()
            rc = self._progress()
            if rc is not None:
                return rc
            self.stop.sleep(0.5)
        return GAVE_UP_STATUS if self.supervisor.in_state(PartState.GIVEN_UP) else 0

    def _progress(self) -> int | None:
        """Start the router once every instance is settled, announce the stack once its
        front answers; an exit status when the stack must stop on its own."""
        sup = self.supervisor
        parts = [sup[p.name] for p in self.instances]
        given_up = sup.in_state(PartState.GIVEN_UP)
        if given_up and not self.o.restart.restart_on_failure:
            return 1
        if all(r.state is PartState.GIVEN_UP for r in parts):
            say("kvtier serve: every instance was given up on")
            return 1
        settled = all(r.state in (PartState.UP, PartState.GIVEN_UP) for r in parts)
        if settled and self.router is None and self.o.router != "none":
            self._start_router()
        front = sup[self.router.name] if self.router else None
        if front is not None and front.state is PartState.GIVEN_UP and not self.announced:
            # nothing ever routed: a stack without its one endpoint serves no one, and a
            # caller waiting for it (a benchmark, a deploy script) would wait for nothing
            say(f"kvtier serve: the {self.o.router} router never came up; stopping")
            return 1
        if not self.announced and settled and (front is None or front.state is PartState.UP):
            self.announced = True
            self._say_status()
            self._write_state()
            if self.o.verify:
                return self._verify()
        return None

    def _start_router(self) -> None:
        o = self.o
        state = o.run_dir / "stack.json"
        argv = router_argv(o.router, o.policy, o.host, o.port,
                           [self.url(i) for i in range(o.instances)],
                           [self.node_url(i) for i in range(o.instances)],
                           o.vllm_router, node_token_file=o.node_token_file,
                           parts_file=state,
                           kv_events=self.kv_event_sources() if o.kv_events else None,
                           extra=o.router_args)
        if argv is None:
            return
        self._write_state()  # the router reads the parts' states from it
        log = o.run_dir / "router.log"
        log.unlink(missing_ok=True)
        # the environment goes with it: kvtier route reads $KVTIER_NODE_TOKEN by default;
        # any HTTP answer counts (kvtier route's /health is 503 while no backend is up)
        self.router = ProcessPart(f"router ({o.router})", argv, log,
                                  f"{self.router_url}/health", only_200=False)
        self.supervisor.add(self.router)

    def _verify(self) -> int:
        from kvtier.verify.run import VerifyOptions, verify

        options = VerifyOptions.from_stack(self.state(), node_token=self.o.node_token())
        return verify(options)

    def _teardown(self) -> None:
        if self.router is not None:
            stop_together([self.router], 30)
        if self.instances:
            say(f"kvtier serve: stopping {len(self.instances)} instance(s)")
            stop_together(self.instances, 90)
        if self.relay is not None:
            self.relay.stop()
        self.services.close()
        self.supervisor.close()
        given_up = self.supervisor.in_state(PartState.GIVEN_UP)
        if given_up:
            say("kvtier serve: stopped; gave up on " + "; ".join(
                f"{r.name} ({r.reason})" for r in given_up))
        else:
            say("kvtier serve: stopped")

    # ------------------------------------------------------------------ reporting

    def state(self) -> dict[str, Any]:
        policy = self.o.restart
        return {
            "router": {"kind": self.o.router, "policy": self.o.policy, "url": self.router_url,
                       "pid": self.router.pid if self.router else None},
            "instances": [{"url": self.url(i), "node": self.node_url(i), "pid": p.pid,
                           "log": str(p.log_path)} for i, p in enumerate(self.instances)],
            "shared": self.shared,
            "kv_events": list(self.kv_event_sources().endpoints) if self.o.kv_events else None,
            "node_token": self.o.node_token_source(),  # where from, never the token
            "restart": {"mode": "on-failure" if policy.restart_on_failure else "never",
                        "limit": policy.limit, "window_s": policy.window_s},
            "parts": {r.name: r.as_dict() for r in self.supervisor},
        }

    def _write_state(self) -> Path:
        path = self.o.run_dir / "stack.json"
        temporary = path.with_name(f".stack.json.{os.getpid()}")
        temporary.write_text(json.dumps(self.state(), indent=2))
        os.replace(temporary, path)  # the router reads it on every /metrics
        return path

    def _changed(self, record: Supervised) -> None:
        if not self.announced:
            return
        self._write_state()
        say("  parts: " + " · ".join(r.summary() for r in self.supervisor))

    def _say_status(self) -> None:
        o = self.o
        front = (f"{o.router} ({o.policy}) at {self.router_url}/v1" if self.router_url
                 else "no router: call the instances directly")
        up = len([p for p in self.instances
                  if self.supervisor[p.name].state is PartState.UP])
        say(f"kvtier serve: {up} instance(s) up; {front}")
        for i in range(o.instances):
            cpu = instance_cpu(i)
            core = f"  core {cpu}" if cpu is not None else ""
            say(f"  instance {i}  {self.url(i)}/v1  node server {self.node_url(i)}{core}")
        if o.kv_events:
            say("  KV events for kv_aware, relayed at "
                + ", ".join(self.kv_event_sources().endpoints))
        tiers = ServerConfig.from_dict({**self.server_config(0), "metrics_port": None})
        say(f"  tiers of each instance: {tiers_line(tiers)}"
            + ("" if self.shared else " (no shared tier)"))
        token = o.node_token_source()
        if token:
            where = token.get("file") or f"${token.get('env')}"
            say(f"  node servers' /v1/* need the bearer token in {where}")
        policy = o.restart
        say("  parts: " + " · ".join(r.summary() for r in self.supervisor)
            + (f"; restarted on failure, at most {policy.limit} times in "
               f"{policy.window_s:.0f} s" if policy.restart_on_failure
               else "; --restart never: the stack stops when one fails"))
        say(f"  check it: kvtier verify --stack {o.run_dir / 'stack.json'}")
        say("  Ctrl-C stops everything.")

