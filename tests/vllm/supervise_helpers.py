"""A bounded request loop through a stack's endpoint, and the stack's parts as its stack.json
tells them: what the fault tests of ``kvtier serve --instances`` drive and count."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from stack_helpers import RunningStack

MODEL = "kvtier-demo"
CHARS = 5000  # about 1100 tokens: 4 full chunks
INSTANCE_BACK_S = 120.0
"""An instance is back in about its own start time under the other instance's load: 27-46 s
on the 2-core test machine (docs/results/faults) once each instance runs wholly on its core
(73-251 s before, when importing torch could wait minutes to move between cores;
docs/serve-stack.md)."""


@dataclass
class Sent:
    prompt: int
    start: float
    end: float = 0.0
    status: int | None = None
    text: str | None = None
    backend: str = ""
    error: str = ""
    refused: int = 0
    """Connections refused before this request was sent (the endpoint was down): re-sent."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.text is not None

    def in_flight(self, at: float) -> bool:
        return self.start <= at <= self.end


def complete(url: str, prompt: str, timeout_s: float = 120.0) -> tuple[int, dict[str, Any],
                                                                        dict[str, str]]:
    """One whole completion; raises ConnectionRefusedError when nothing was sent."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                      timeout=timeout_s)
    try:
        conn.connect()  # refused here: nothing was sent
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8,
                           "temperature": 0.0}).encode()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = {"raw": raw[:200].decode(errors="replace")}
        return resp.status, doc if isinstance(doc, dict) else {}, dict(resp.getheaders())
    finally:
        conn.close()


@dataclass
class Loop:
    """``clients`` threads sending the prompts in turn through ``url`` until stopped, at most
    ``limit`` requests in all; a refused connection is re-sent (at most 200 times, 0.1 s
    apart), every other error is a failed request."""

    url: str
    prompts: list[str]
    clients: int = 2
    limit: int = 12000
    """About 15 requests a second here: room for a 240 s restart and the minute after it
    (3000 ran out once, while an instance took 186 s to come back)."""
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Loop:
        for c in range(self.clients):
            thread = threading.Thread(target=self._client, args=(c,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> list[Sent]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
        return self.sent

    def ok_since(self, t: float) -> int:
        with self._lock:
            return len([s for s in self.sent if s.ok and s.start >= t])

    def _client(self, c: int) -> None:
        n = c
        while not self._stop.is_set():
            with self._lock:
                if len(self.sent) >= self.limit:
                    return
                record = Sent(n % len(self.prompts), time.monotonic())
                self.sent.append(record)
            self._one(record)
            n += self.clients

    def _one(self, record: Sent) -> None:
        for _ in range(200):
            try:
                status, doc, headers = complete(self.url, self.prompts[record.prompt])
            except ConnectionRefusedError:
                record.refused += 1
                time.sleep(0.1)
                continue
            except (OSError, http.client.HTTPException) as exc:
                record.error = f"{type(exc).__name__}: {exc}"
                break
            record.status = status
            record.backend = headers.get("X-Kvtier-Backend", "")
            if status == 200:
                record.text = doc["choices"][0]["text"]
            else:
                record.error = json.dumps(doc)[:300]
            break
        else:
            record.error = "refused 200 times"
        record.end = time.monotonic()


def parts(stack: RunningStack) -> dict[str, dict[str, Any]]:
    return dict(stack.state().get("parts") or {})


def wait_part(stack: RunningStack, name: str, state: str, *, restarts: int | None = None,
              timeout_s: float = 180.0) -> float:
    """Seconds until part ``name`` is in ``state`` (with at least ``restarts``)."""
    start = time.monotonic()
    while True:
        part = parts(stack).get(name) or {}
        if part.get("state") == state and (restarts is None or part["restarts"] >= restarts):
            return time.monotonic() - start
        assert stack.proc.poll() is None, f"the stack exited:\n{stack.output()}"
        assert time.monotonic() - start < timeout_s, \
            f"{name} not {state} after {timeout_s:.0f} s: {part}\n{stack.output()[-3000:]}"
        time.sleep(0.25)


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                .decode(errors="replace"))
    except OSError:
        return ""


def api_server(instance_pid: int) -> int:
    """vLLM's API server under an instance's ``kvtier serve``."""
    found = [p for p in children(instance_pid) if "vllm.entrypoints" in cmdline(p)]
    assert len(found) == 1, [(p, cmdline(p)) for p in children(instance_pid)]
    return found[0]


def engine_core(instance_pid: int) -> int:
    """The EngineCore process under that API server."""
    api = api_server(instance_pid)
    found = [p for p in children(api) if "EngineCore" in _comm(p) + cmdline(p)]
    assert len(found) == 1, [(p, _comm(p), cmdline(p)) for p in children(api)]
    return found[0]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def wait_gone(pgid: int, timeout_s: float) -> float:
    """When process group ``pgid`` was empty (zombies aside): until then what the killed
    process shared its sockets with (its group) may still accept connections."""
    deadline = time.monotonic() + timeout_s
    while any(_running_threads(pid) for pid in _group(pgid)):
        assert time.monotonic() < deadline, f"process group {pgid} still there"
        time.sleep(0.01)
    return time.monotonic()


def _group(pgid: int) -> list[int]:
    """Every process of group ``pgid``, zombie leaders included: a killed process's leader
    thread is a zombie before its other threads (and its sockets) are gone."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid:
                out.append(int(entry.name))
    return out


def _running_threads(pid: int) -> bool:
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except (OSError, IndexError):
            continue
    return False


def report(what: str, sent: list[Sent], killed_at: float,
           gone_at: float | None = None) -> list[Sent]:
    """Print every request of the loop (the test output lists the failed ones) and return
    the failed ones."""
    failed = [s for s in sent if not s.ok]
    print(f"\n{what}: {len(sent)} requests, {len(failed)} failed, "
          f"{sum(s.refused for s in sent)} refused connections re-sent")
    for s in sent:
        if not s.ok:
            on = s.start <= (gone_at or killed_at) and s.end >= killed_at
            where = "in flight on the killed part" if on else "NOT in flight"
            print(f"  FAILED prompt {s.prompt} at {s.start - killed_at:+.2f}..."
                  f"{s.end - killed_at:+.2f} s ({where}): {s.status} {s.error}")
    return failed


def prompt(tag: str, i: int) -> str:
    from kvtier.demo.model import corpus_text

    text = corpus_text()
    start = (i * 997) % (len(text) - CHARS)
    return f"supervise {tag} {i} {uuid.uuid4().hex}\n{text[start:start + CHARS]}"


def cold_run(stack: RunningStack, prompts: int, probes: int) -> dict[str, Any]:
    """The loop's prompts and one probe prompt per instance restart, each sent once and
    computed from scratch: the cold run every later answer is compared with."""
    loop_prompts = [prompt("loop", i) for i in range(prompts)]
    probe_prompts = [prompt("probe", i) for i in range(probes)]
    texts: dict[str, str] = {}
    for text in loop_prompts + probe_prompts:
        status, doc, _ = complete(stack.url, text)
        assert status == 200, doc
        if "kv_transfer_params" in doc:
            tokens = doc["kv_transfer_params"]["kvtier"]["tokens"]
            assert tokens.get("recomputed") == doc["usage"]["prompt_tokens"], \
                f"not a cold run: {tokens}"
        texts[text] = doc["choices"][0]["text"]
    time.sleep(2)  # write-through to the shared tier
    return {"prompts": loop_prompts, "probes": probe_prompts, "texts": texts}


def all_up(stack: RunningStack) -> None:
    for name in parts(stack):
        wait_part(stack, name, "up")


def fault(stack: RunningStack, cold: dict[str, Any], name: str, victim: int,
          sig: signal.Signals, back_s: float) -> tuple[list[Sent], float]:
    """Run the loop, send ``sig`` to process ``victim`` of part ``name`` once the loop is
    served, wait until the part is up again (restart count +1), let the loop be served a few
    more times; check the failures and the texts. A request may fail only if it was in
    flight on the part between the signal and the end of the victim's process group (what
    shares the victim's sockets goes when the stack kills the group; a SIGSTOPped one ends
    when the stack finds it hung)."""
    all_up(stack)
    restarts = parts(stack)[name]["restarts"]
    loop = Loop(stack.url, cold["prompts"]).start()
    try:
        began = time.monotonic()
        while loop.ok_since(began) < 3:
            assert time.monotonic() - began < 60, "the loop does not get answers"
            time.sleep(0.1)
        pgid = os.getpgid(victim)
        killed_at = time.monotonic()
        os.kill(victim, sig)
        gone_at = wait_gone(pgid, 120.0)
        took = wait_part(stack, name, "up", restarts=restarts + 1, timeout_s=back_s)
        back = time.monotonic()
        while loop.ok_since(back) < 4:
            assert time.monotonic() - back < 60, "the loop does not get answers after"
            time.sleep(0.1)
    finally:
        sent = loop.stop()
    failed = report(f"{name}: back in {took:.0f} s; its process ended "
                    f"{gone_at - killed_at:.2f} s after the signal", sent, killed_at, gone_at)
    assert all(s.start <= gone_at and s.end >= killed_at for s in failed), \
        "only requests in flight on the killed part may fail"
    done = [s for s in sent if s.ok]
    assert len(done) >= 7
    for s in done:
        assert s.text == cold["texts"][cold["prompts"][s.prompt]], \
            f"prompt {s.prompt}: {s.text!r} differs from the cold run"
    return failed, took


def warm(stack: RunningStack, cold: dict[str, Any], i: int, probe: int) -> None:
    """The restarted instance's first request for a known prefix: from the shared tier."""
    prompt = cold["probes"][probe]
    status, doc, _ = complete(stack.state()["instances"][i]["url"], prompt)
    assert status == 200, doc
    tokens = doc["kv_transfer_params"]["kvtier"]["tokens"]
    assert tokens.get("shared", 0) >= 4 * 256, f"not from the shared tier: {tokens}"
    assert "arena" not in tokens, "a new node server's arena starts empty"
    assert doc["choices"][0]["text"] == cold["texts"][prompt]
