"""The node HTTP API against hostile clients: the bearer token (401 without it or with a
wrong one, never logged) and slow clients (a whole-request deadline; tricklers cannot lock
/metrics and /v1/lookup out)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from store_helpers import MakeServer, client_store, keys, wait_until

from kvtier.client import KvtierClient
from kvtier.errors import ConfigError
from kvtier.ports import free_ports
from kvtier.server.http import MAX_CONNECTIONS, Connections

from .test_http import fetch

TOKEN_ENV = "KVTIER_TEST_NODE_TOKEN"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    value = secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, value)
    return value


def guarded(make_server: MakeServer, **auth: object) -> int:
    server = make_server(metrics_port=0, frame_timeout_s=2.0,
                         auth={"http_token_env": TOKEN_ENV, **auth})
    assert server.metrics_port
    return server.metrics_port


# ---------------------------------------------------------------------- the token

def test_protected_paths_need_the_token(make_server: MakeServer, token: str) -> None:
    port = guarded(make_server)
    lookup = {"keys": [k.hex() for k in keys(2)]}
    for path, body in (("/v1/lookup", lookup), ("/v1/namespaces", None), ("/v1/stats", None)):
        status, doc = fetch(port, path, body)
        assert status == 401 and "Authorization: Bearer" in doc["error"], path
        assert "no Authorization header" in doc["error"]
        status, doc = fetch(port, path, body, headers=bearer(secrets.token_hex(16)))
        assert status == 401 and "wrong bearer token" in doc["error"], path
        for almost in (token[:-1], token + "x", token.upper(), f"Basic {token}"):
            header = almost if almost.startswith("Basic") else f"Bearer {almost}"
            assert fetch(port, path, body, headers={"Authorization": header})[0] == 401
        assert fetch(port, path, body, headers=bearer(token))[0] == 200, path
    assert fetch(port, "/v1/stats", headers={"Authorization": f"bearer  {token} "})[0] == 200
    assert fetch(port, "/metrics")[0] == 200, "/metrics stays open by default"
    assert fetch(port, "/healthz")[0] == 200
    assert fetch(port, "/nope")[0] == 404


def test_a_refusal_says_bearer_and_keeps_serving(make_server: MakeServer, token: str) -> None:
    port = guarded(make_server)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/stats")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=5)
    assert refused.value.code == 401
    assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert token not in refused.value.read().decode()
    assert fetch(port, "/v1/stats", headers=bearer(token))[0] == 200


def test_metrics_can_need_the_token_too(make_server: MakeServer, token: str) -> None:
    port = guarded(make_server, metrics_need_token=True)
    assert fetch(port, "/metrics")[0] == 401
    status, text = fetch(port, "/metrics", headers=bearer(token))
    assert status == 200 and "kvtier_lookup_chunks_total" in text
    assert fetch(port, "/healthz")[0] == 200, "health stays open (says nothing cached)"


def test_without_a_token_the_api_answers_anyone(make_server: MakeServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    port = guarded(make_server)
    assert fetch(port, "/v1/stats")[0] == 200
    assert fetch(port, "/v1/stats", headers=bearer("anything"))[0] == 200


def test_the_token_from_an_owner_only_file(make_server: MakeServer, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    value = secrets.token_hex(16)
    path = tmp_path / "node-token"
    path.write_text(f"# the node token\n{value}\n{secrets.token_hex(16)}\n")
    path.chmod(0o600)
    port = guarded(make_server, http_token_file=str(path))
    assert fetch(port, "/v1/stats")[0] == 401
    assert fetch(port, "/v1/stats", headers=bearer(value))[0] == 200, "the first entry"
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others") as refused:
        make_server(metrics_port=0, socket_path=str(tmp_path / "b.sock"),
                    auth={"http_token_file": str(path)})
    assert value not in str(refused.value)


def test_every_listed_token_is_accepted_while_one_is_rotated(
        make_server: MakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation: the node accepts the old and the new token at once (the router switches
    between two rollouts without a refusal); a token listed by neither is still refused."""
    old, new = secrets.token_hex(16), secrets.token_hex(16)
    monkeypatch.setenv(TOKEN_ENV, f"{old},{new}")
    port = guarded(make_server)
    for accepted in (old, new):
        assert fetch(port, "/v1/stats", headers=bearer(accepted))[0] == 200
    for refused in (secrets.token_hex(16), f"{old},{new}", old + new, ""):
        assert fetch(port, "/v1/stats", headers=bearer(refused))[0] == 401, refused


def test_the_token_is_never_logged(tmp_path: Path) -> None:
    """A real ``kvtier server`` logging at debug, asked with the token, a wrong one and
    none: neither token appears in what it printed."""
    value, wrong = secrets.token_hex(16), secrets.token_hex(16)
    port = free_ports(1)[0]
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({
        "socket_path": str(tmp_path / "run" / "kvtier.sock"), "log_level": "debug",
        "log_format": "text", "metrics_port": port,
        "arena": {"size_bytes": 8 * 8192, "slot_bytes": 8192}}))
    env = {**os.environ, "KVTIER_NODE_TOKEN": value}
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "server", "--config", str(config)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: _up(port), 30.0), "the server came up"
        assert fetch(port, "/v1/stats", headers=bearer(value))[0] == 200
        assert fetch(port, "/v1/lookup", {"keys": []}, headers=bearer(wrong))[0] == 401
        assert fetch(port, "/v1/namespaces")[0] == 401
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(f"GET /v1/stats HTTP/1.1\r\nAuthorization: Bearer {wrong}\r\n"
                         f"Bad header line {wrong}\r\n\r\n".encode())
            sock.recv(65536)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    text = out.decode(errors="replace")
    assert "need the bearer token" in text, "it says the API is guarded"
    assert "http: " in text, "debug request lines were logged"
    assert value not in text and wrong not in text


def _up(port: int) -> bool:
    try:
        return fetch(port, "/healthz")[0] == 200
    except OSError:
        return False


# ---------------------------------------------------------------------- slow clients

def test_a_trickle_gets_no_more_time_than_silence(make_server: MakeServer) -> None:
    """One byte every 0.2 s keeps a per-read timeout happy for ever; the whole request
    still has to arrive within the deadline (2 s here)."""
    server = make_server(metrics_port=0, frame_timeout_s=2.0)
    assert server.metrics_port
    with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=5) as sock:
        start = time.monotonic()
        line = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 1000
        try:
            for byte in line:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass  # closed under us: what the test wants
        took = time.monotonic() - start
        assert took < 4.0, f"still open after {took:.1f} s of trickling"
        assert took > 1.5, "not closed before its deadline"


def test_a_request_cut_in_half_is_dropped_at_its_deadline(make_server: MakeServer) -> None:
    server = make_server(metrics_port=0, frame_timeout_s=1.5)
    port = server.metrics_port
    assert port
    body = b'{"keys": []}' + b" " * 188
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
                     + body[:100])
        start = time.monotonic()
        assert sock.recv(65536) == b"", "closed without an answer"
        assert 1.0 < time.monotonic() - start < 3.5
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/stats HTTP/1.1\r\nHost: x\r\n")  # headers never ended
        start = time.monotonic()
        assert sock.recv(65536) == b""
        assert 1.0 < time.monotonic() - start < 3.5
    status, doc = fetch(port, "/v1/lookup", body)
    assert status == 200 and doc["tiers"] == [], "the same request whole is answered"


class Trickler:
    """``n`` connections each sending a request one byte a second, reopened as soon as the
    server closes one (the attacker of issue 15, item 7)."""

    def __init__(self, port: int, n: int) -> None:
        self.port, self.n = port, n
        self.stop = threading.Event()
        self.reopened = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Trickler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(timeout=10)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        sock.sendall(b"G")
        return sock

    def _run(self) -> None:
        socks = [self._open() for _ in range(self.n)]
        try:
            while not self.stop.wait(0.05):
                for i, sock in enumerate(socks):
                    if self.stop.is_set():
                        break
                    try:
                        sock.sendall(b"E")
                        sock.setblocking(False)
                        try:
                            if sock.recv(1) == b"":
                                raise ConnectionResetError
                        except BlockingIOError:
                            pass
                        finally:
                            sock.setblocking(True)
                    except OSError:
                        sock.close()
                        socks[i] = self._open()
                        self.reopened += 1
                self.stop.wait(1.0)
        finally:
            for sock in socks:
                sock.close()


def test_tricklers_do_not_lock_out_metrics_and_lookups(make_server: MakeServer,
                                                       token: str) -> None:
    server = make_server(metrics_port=0, frame_timeout_s=2.0,
                         auth={"http_token_env": TOKEN_ENV})
    port = server.metrics_port
    assert port
    k = keys(3)
    with KvtierClient(server.socket_path) as client:
        client_store(client, k[:2])
    with Trickler(port, MAX_CONNECTIONS + 16) as attack:
        time.sleep(3.0)  # every place taken, and past one deadline: they reopen
        for _ in range(5):
            start = time.monotonic()
            status, text = fetch(port, "/metrics")
            assert status == 200 and "kvtier_lookup_chunks_total" in text
            status, doc = fetch(port, "/v1/lookup", {"keys": [x.hex() for x in k]},
                                headers=bearer(token))
            assert status == 200 and doc["tiers"] == ["arena", "arena"]
            took = time.monotonic() - start
            assert took < 3.0, f"a scrape and a lookup took {took:.1f} s under attack"
            time.sleep(0.3)
        assert attack.reopened >= MAX_CONNECTIONS, "the server cut the tricklers off"


def test_only_a_connection_waiting_for_its_request_gives_way() -> None:
    """The rule behind the last test, on real socket pairs: a newcomer takes the place of
    the connection that has waited longest for its request, never of one being answered."""
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        conns = Connections(2)
        (a, peer_a), (b, peer_b), (c, _), (d, _) = pairs
        assert conns.admit(a) and conns.admit(b)
        assert conns.mark(a, waiting=False) and conns.mark(b, waiting=False)
        assert not conns.admit(c), "every place busy answering: the newcomer is refused"
        time.sleep(0.01)
        assert conns.mark(b, waiting=True)  # b's answer went out; it waits for more
        assert conns.admit(c), "b gave its place up"
        peer_b.settimeout(5)
        assert peer_b.recv(1) == b"", "b was shut down"
        assert not conns.mark(b, waiting=False), "b's handler learns it was evicted"
        assert conns.mark(c, waiting=False)
        assert not conns.admit(d)
        peer_a.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer_a.recv(1)  # a, being answered, is untouched
        assert conns.evicted == 1
    finally:
        for x, y in pairs:
            x.close()
            y.close()
