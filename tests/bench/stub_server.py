"""A small OpenAI-shaped HTTP server on 127.0.0.1 for the benchmark client's tests.

Real HTTP and real SSE (no mocked transport): ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions`` (streamed or whole) and ``/metrics``. A prompt counts one token per four
bytes; its cached part is the longest prompt seen before that it starts with (the "prefix
cache"). ``accounting`` picks what a response says about it: ``kvtier``
(``kv_transfer_params`` on whole responses, and on the last chunk too with ``kv_on_stream``),
``cached`` (``usage.prompt_tokens_details``) or ``none``. ``failures`` maps (user, round),
read from the synthetic question's lead, to ``http500`` or ``midstream``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_TURN = re.compile(r"Question (\d+) from user (\d+):")


@dataclass
class StubState:
    accounting: str = "cached"
    kv_on_stream: bool = False
    backend: str | None = None
    """Named in an ``X-Kvtier-Backend`` header, as ``kvtier route`` does."""
    estimate: str | None = None
    """Sent as ``X-Kvtier-Estimate``, as ``kvtier route --strategy cache`` does."""
    ttft_s: float = 0.02
    token_s: float = 0.004
    failures: dict[tuple[int, int], str] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    prompt_total: int = 0
    cached_total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def account(self, prompt: str) -> tuple[int, int]:
        tokens = -(-len(prompt.encode()) // 4)
        with self.lock:
            best = max((len(p) for p in self.seen if prompt.startswith(p)), default=0)
            self.seen.append(prompt)
            cached = min(tokens, best // 4)
            self.prompt_total += tokens
            self.cached_total += cached
        return tokens, cached


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"<{m['role']}>{m['content']}" for m in body["messages"])
    return str(body["prompt"])


def _turn_of(body: dict[str, Any]) -> tuple[int, int] | None:
    text = body["messages"][-1]["content"] if "messages" in body else str(body["prompt"])
    found = _TURN.findall(text)
    if not found:
        return None
    question, user = found[-1]
    return int(user), int(question) - 1


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *_args: object) -> None:
        pass

    def _name_backend(self) -> None:
        if self.server.state.backend is not None:
            self.send_header("X-Kvtier-Backend", self.server.state.backend)
        if self.server.state.estimate is not None:
            self.send_header("X-Kvtier-Estimate", self.server.state.estimate)

    def _json(self, status: int, doc: object) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self._name_backend()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        state = self.server.state
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "stub-model"}]})
        elif self.path == "/metrics":
            text = (f"# TYPE vllm:prompt_tokens_total counter\n"
                    f'vllm:prompt_tokens_total{{engine="0"}} {state.prompt_total}\n'
                    f'vllm:prompt_tokens_cached_by_source_total{{engine="0",source="device"}} '
                    f"{state.cached_total}\n"
                    f'vllm:prompt_tokens_cached_by_source_total{{engine="0",source="host"}} 0\n')
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with state.lock:
            state.bodies.append(body)
            state.headers.append(dict(self.headers))
        failure = state.failures.get(_turn_of(body) or (-1, -1))
        if failure == "http500":
            self._json(500, {"error": {"message": "injected failure"}})
            return
        prompt_tokens, cached = state.account(_prompt_of(body))
        chat = self.path.endswith("/chat/completions")
        n = int(body["max_tokens"])
        pieces = [f" w{i}" for i in range(n)]
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n}
        if state.accounting == "cached":
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        kv = {"kvtier": {"prompt_tokens": prompt_tokens, "tokens": {
            "device": 0, "arena": cached, "recomputed": prompt_tokens - cached}}}
        if body.get("stream"):
            self._stream(chat, pieces, usage, kv, failure == "midstream", body)
            return
        time.sleep(state.ttft_s + state.token_s * n)
        choice = ({"message": {"role": "assistant", "content": "".join(pieces)}} if chat
                  else {"text": "".join(pieces)})
        doc: dict[str, Any] = {"id": "x", "choices": [choice], "usage": usage}
        if state.accounting == "kvtier":
            doc["kv_transfer_params"] = kv
        self._json(200, doc)

    def _stream(self, chat: bool, pieces: list[str], usage: dict[str, Any],
                kv: dict[str, Any], fail: bool, body: dict[str, Any]) -> None:
        state = self.server.state
        self.send_response(200)
        self._name_backend()
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(doc: object) -> None:
            self.wfile.write(f"data: {json.dumps(doc)}\n\n".encode())
            self.wfile.flush()

        time.sleep(state.ttft_s)
        for i, piece in enumerate(pieces):
            if i:
                time.sleep(state.token_s)
            if fail and i == len(pieces) // 2:
                send({"error": {"message": "injected mid-stream failure", "code": 500}})
                self.wfile.write(b"data: [DONE]\n\n")
                return
            choice = {"delta": {"content": piece}} if chat else {"text": piece}
            chunk: dict[str, Any] = {"id": "x", "choices": [choice]}
            if i == len(pieces) - 1 and state.accounting == "kvtier" and state.kv_on_stream:
                chunk["kv_transfer_params"] = kv
            send(chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            send({"id": "x", "choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: StubState, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.state = state


@contextmanager
def stub_server(state: StubState | None = None) -> Iterator[tuple[str, StubState]]:
    """``(base_url, state)`` of a running stub; shut down on exit."""
    st = state or StubState()
    server = _Server(st)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", st
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def main() -> None:
    """``python stub_server.py --port P``: serve until SIGTERM (for sweep tests)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--accounting", default="cached")
    args = parser.parse_args()
    server = _Server(StubState(accounting=args.accounting, ttft_s=0.005, token_s=0.001),
                     port=args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
