"""``kvtier verify`` without a stack: reading counters, telling who served, and failing
loudly (naming the step) when the entry point does not answer."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.verify.observe import Snapshot, chunk_files, counters, hits_by_tier, served_by
from kvtier.verify.run import Sent, Verification, VerifyOptions

METRICS = """# HELP kvtier_hits_total Chunks leased
kvtier_hits_total{tier="arena"} 3.0
kvtier_hits_total{tier="shared"} 7.0
kvtier_request_seconds_count{op="lookup"} 12.0
kvtier_request_seconds_count{op="lease"} 2.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
vllm:other_total 9.0
"""


def test_counters_are_summed_per_tier_and_op() -> None:
    got = counters(METRICS, ("kvtier_hits_total", "kvtier_request_seconds_count",
                             "vllm:request_success_total"))
    assert got == {"kvtier_hits_total|arena": 3.0, "kvtier_hits_total|shared": 7.0,
                   "kvtier_request_seconds_count|lookup": 12.0,
                   "kvtier_request_seconds_count|lease": 2.0,
                   "vllm:request_success_total": 5.0}


def test_the_instance_whose_vllm_finished_a_request_served_it() -> None:
    before = Snapshot([{"vllm:request_success_total": 5.0, "kvtier_hits_total|shared": 1.0},
                       {"vllm:request_success_total": 2.0}])
    after = Snapshot([{"vllm:request_success_total": 5.0, "kvtier_hits_total|shared": 1.0},
                      {"vllm:request_success_total": 3.0, "kvtier_hits_total|shared": 4.0}])
    assert served_by(before, after) == 1
    assert hits_by_tier(before, after, 1) == {"shared": 4}
    both = Snapshot([{"vllm:request_success_total": 6.0}, {"vllm:request_success_total": 3.0}])
    assert served_by(before, both) is None, "two instances moved: unknown"
    by_lookup = Snapshot([{"kvtier_request_seconds_count|lookup": 1.0}, {}])
    assert served_by(Snapshot([{}, {}]), by_lookup) == 0


def test_chunk_files_of_an_fs_tier(tmp_path: Path) -> None:
    assert chunk_files(tmp_path) == 0
    (tmp_path / "chunks" / "ab" / "cd").mkdir(parents=True)
    for name in ("1.kvc", "2.kvc", "3.tmp"):
        (tmp_path / "chunks" / "ab" / "cd" / name).write_bytes(b"x")
    assert chunk_files(tmp_path) == 2


def test_options_from_a_stack_file() -> None:
    state = {"router": {"url": "http://r:1"}, "shared": {"type": "fs",
                                                         "options": {"path": "/s"}},
             "instances": [{"url": "http://a:2", "node": "http://a:3"},
                           {"url": "http://b:2", "node": "http://b:3"}]}
    o = VerifyOptions.from_stack(state, attempts=2)
    assert (o.url, o.kvtier_servers, o.backends, o.shared_path, o.attempts) == (
        "http://r:1", ("http://a:3", "http://b:3"), ("http://a:2", "http://b:2"),
        Path("/s"), 2)
    no_router = VerifyOptions.from_stack({**state, "router": {"url": None}})
    assert no_router.url == "http://a:2"


def test_a_dead_entry_point_fails_step_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "kvtier", "verify", "--url",
                             f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "[1/5] entry point      FAIL" in result.stdout
    assert "FAILED step 1 (entry point)" in result.stdout
    missing = subprocess.run([sys.executable, "-m", "kvtier", "verify"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "give --url or --stack" in missing.stderr


SECRET = "sk-verify-never-shown-4711"


class _KeyCheckingEntry:
    """A real HTTP entry point on 127.0.0.1 that records the Authorization it gets, lists a
    model, and answers completions with a 400 (so verify stops at step 2)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.seen: list[str] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status: int, body: bytes) -> None:
                seen.append(self.headers.get("Authorization", ""))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(200, b'{"data": [{"id": "m"}]}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(400, b'{"error": {"message": "no"}}')

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_api_key_is_never_in_the_repr() -> None:
    o = VerifyOptions(url="http://x:1", api_key=SECRET)
    assert SECRET not in repr(o) and SECRET not in str(o)


def test_the_api_key_comes_from_the_environment_or_a_file_and_is_never_printed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    from kvtier.cli import main

    entry = _KeyCheckingEntry()
    try:
        monkeypatch.setenv("KVTIER_VERIFY_TEST_KEY", SECRET)
        assert main(["verify", "--url", entry.url, "--api-key-env",
                     "KVTIER_VERIFY_TEST_KEY"]) == 1  # step 2 fails on the 400
        key_file = tmp_path / "key"
        key_file.write_text(SECRET + "\n")
        assert main(["verify", "--url", entry.url, "--api-key-file", str(key_file)]) == 1
        out = capsys.readouterr()
        assert "[1/5] entry point      ok" in out.out
        assert SECRET not in out.out + out.err
        assert entry.seen and set(entry.seen) == {f"Bearer {SECRET}"}
        assert main(["verify", "--url", entry.url, "--api-key-env", "KVTIER_UNSET_VAR"]) == 2
        assert "KVTIER_UNSET_VAR is not set" in capsys.readouterr().err
        # the old flag still works, with a warning; the key is not echoed
        entry.seen.clear()
        assert main(["verify", "--url", entry.url, "--api-key", SECRET]) == 1
        out = capsys.readouterr()
        assert "--api-key is deprecated" in out.err and SECRET not in out.out + out.err
        assert set(entry.seen) == {f"Bearer {SECRET}"}
    finally:
        entry.close()


def test_a_request_to_an_instance_directly_carries_no_entry_point_key() -> None:
    from kvtier.httpjson import HttpError

    entry, instance = _KeyCheckingEntry(), _KeyCheckingEntry()
    try:
        v = Verification(VerifyOptions(url=entry.url, api_key=SECRET), say=lambda _: None)
        with pytest.raises(HttpError):
            v.send("to the entry point")
        with pytest.raises(HttpError):
            v.send("to an instance", url=instance.url)
    finally:
        entry.close()
        instance.close()
    assert entry.seen == [f"Bearer {SECRET}"] and instance.seen == [""]


class _Scripted(Verification):
    """Step 5's logic on scripted answers: ``send`` returns the next prepared request (the
    HTTP path is covered by the tests above and the vLLM end-to-end test)."""

    def __init__(self, answers: list[Sent], backends: tuple[str, ...] = ()) -> None:
        self.lines: list[str] = []
        self.urls: list[str | None] = []
        super().__init__(VerifyOptions(url="http://x:1", attempts=3, backends=backends),
                         say=self.lines.append)
        self.shared = {"shared"}
        self.answers = answers

    def send(self, suffix: str, user: str | None = None, *, url: str | None = None) -> Sent:
        self.urls.append(url)
        return self.answers.pop(0)


def _sent(instance: int | None, shared_chunks: int = 0) -> Sent:
    return Sent(0.1, {}, instance, {"shared": shared_chunks} if shared_chunks else {})


def _step5(first: Sent, second: Sent | None, later: list[Sent]) -> tuple[bool, str]:
    v = _Scripted(later)
    ok = v.another_instance(first, second)
    return ok, v.lines[-1]


def test_step_5_without_a_known_home_does_not_count_step_4s_own_request() -> None:
    # step 2's instance unknown; step 4 on instance 0 got shared hits; the rest stay on 0
    ok, line = _step5(_sent(None), _sent(0, shared_chunks=5), [_sent(0), _sent(0), _sent(0)])
    assert not ok and "went to instance 0 (which served step 4)" in line, line


def test_step_5_without_a_known_home_needs_another_instance_than_step_4s() -> None:
    ok, line = _step5(_sent(None), _sent(0, shared_chunks=5), [_sent(0), _sent(1, 3)])
    assert ok and "instance 1 (not instance 0, which served step 4)" in line, line


def test_step_5_fails_when_no_instance_is_known() -> None:
    ok, line = _step5(_sent(None), _sent(None, shared_chunks=5), [_sent(None, 5)] * 3)
    assert not ok and "cannot tell which instance" in line, line


def test_step_5_counts_step_4_when_it_went_elsewhere_than_the_home() -> None:
    ok, line = _step5(_sent(0), _sent(1, shared_chunks=2), [])
    assert ok and "instance 1 (not instance 0, which computed it)" in line, line
    ok, line = _step5(_sent(0), _sent(0, shared_chunks=2), [_sent(0), _sent(None, 4),
                                                            _sent(0)])
    assert not ok and "went to instance 0 (which computed it)" in line, line


def test_step_5_asks_another_instance_directly_when_the_entry_point_keeps_the_prefix_home(
        ) -> None:
    """A cache-aware router sends every request for a held prefix to its holder: with the
    instances' URLs known, the last request goes to another one directly (and says so)."""
    v = _Scripted([_sent(0), _sent(0), _sent(0), _sent(None, shared_chunks=4)],
                  backends=("http://a:1", "http://b:1"))
    assert v.another_instance(_sent(0), _sent(0))
    assert v.urls == [None, None, None, "http://b:1"]
    assert "instance 1 was asked directly" in v.lines[-1], v.lines
    assert "instance 1 (not instance 0, which computed it) served 1024" in v.lines[-1]
    # asked directly, it must still load from the shared tier
    v = _Scripted([_sent(0)] * 3 + [_sent(1)], backends=("http://a:1", "http://b:1"))
    assert not v.another_instance(_sent(0), _sent(0))
    assert "served 0 prompt tokens" in v.lines[-1]
