"""Discovery sources as hostile input: a backends file (lines, YAML, JSON) and DNS answers,
checked, bounded, and failing whole so that the last good set is kept."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.router.sources import (
    MAX_FILE_BYTES,
    BackendSpec,
    DnsName,
    DnsSource,
    FileSource,
    SourceFailed,
    parse_backends,
)


def test_lines_with_comments_and_node_columns() -> None:
    text = """# the fleet
http://10.0.0.5:8000
http://10.0.0.6:8000/   http://10.0.0.6:9100   # its node server elsewhere
http://[fd00::7]:8000
http://10.0.0.5:8000
"""
    assert parse_backends(text, "f", 8100) == [
        BackendSpec("http://10.0.0.5:8000", "http://10.0.0.5:8100"),
        BackendSpec("http://10.0.0.6:8000", "http://10.0.0.6:9100"),
        BackendSpec("http://[fd00::7]:8000", "http://[fd00::7]:8100")]
    assert parse_backends("http://a:1\n", "f", None) == [BackendSpec("http://a:1", None)]
    assert parse_backends("# nobody now\n", "f", 8100) == []


def test_yaml_and_json_lists() -> None:
    yaml_text = "- http://a:8000\n- {url: 'http://b:8000', node: 'http://b-node:1'}\n"
    assert parse_backends(yaml_text, "f", 8100) == [
        BackendSpec("http://a:8000", "http://a:8100"),
        BackendSpec("http://b:8000", "http://b-node:1")]
    json_text = json.dumps([{"url": "https://c:443"}, "http://d:8000"])
    assert parse_backends(json_text, "f", None) == [BackendSpec("https://c:443", None),
                                                    BackendSpec("http://d:8000", None)]


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"),
    ("  \n\n", "empty"),
    ("http://a:8000 http://b:1 extra\n", "line 1: expected 'URL"),
    ("http://a:8000\nftp://b:21\n", "line 2: 'ftp://b:21' is not an http"),
    ("http://user:secret@a:8000\n", "carries credentials"),
    ("http://a:99999\n", "Port out of range"),
    ("http://a:8000?x=1\n", "no query"),
    ("10.0.0.5:8000\n", "is not an http"),
    ("- http://a:8000\n- {url: http://b:1, weight: 3}\n", "f[1]: unknown key 'weight'"),
    ("- {node: 'http://b:1'}\n", "missing key url"),
    ("- 17\n", "f[0]: expected a URL or"),
    ("[1, 2\n", "not YAML/JSON"),
    ("- [http://a:8000]\n", "expected a URL or a {url, node} mapping"),
])
def test_a_bad_file_is_refused_whole_naming_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_backends(text, "f", 8100)
    assert why in str(caught.value)
    assert "secret" not in str(caught.value)


def test_file_source_bounds_size_count_and_encoding(tmp_path: Path) -> None:
    path = tmp_path / "backends"
    source = FileSource(path, 8100, max_backends=3)
    with pytest.raises(SourceFailed, match="cannot read it"):
        asyncio.run(source.found())
    path.write_text("".join(f"http://10.0.0.{i}:8000\n" for i in range(1, 11)))
    found = asyncio.run(source.found())
    assert [b.url for b in found.backends] == [f"http://10.0.0.{i}:8000" for i in (1, 2, 3)]
    assert found.dropped == 7
    path.write_bytes(b"http://a:1\n\xff\n")
    with pytest.raises(SourceFailed, match="not UTF-8"):
        asyncio.run(source.found())
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(SourceFailed, match="over"):
        asyncio.run(source.found())


@pytest.mark.parametrize(("raw", "why"), [
    ("vllm.default.svc:8000", "not an http"),
    ("http://vllm.default.svc", "give the backends' port"),
    ("http://vllm.default.svc:8000/v1", "no path"),
    ("http://u:p@vllm:8000", "credentials"),
])
def test_dns_names_are_checked(raw: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        DnsName.parse(raw)


def fixed(answers: list[Sequence[str] | BaseException]) -> tuple[list[str], object]:
    asked: list[str] = []

    async def resolve(host: str, port: int) -> Sequence[str]:
        asked.append(host)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer
    return asked, resolve


def test_dns_answers_become_backends_filtered_sorted_and_bounded() -> None:
    asked, resolve = fixed([
        ["10.0.0.9", "10.0.0.3", "10.0.0.3", "0.0.0.0", "224.0.0.1", "fd00::1", "junk",
         "10.0.0.10"],
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
        ["0.0.0.0"]])
    source = DnsSource(DnsName.parse("http://vllm.ns.svc:8000"), 8100, max_backends=3,
                       timeout_s=1.0, resolve=resolve)  # type: ignore[arg-type]
    found = asyncio.run(source.found())
    assert found.backends == (
        BackendSpec("http://10.0.0.3:8000", "http://10.0.0.3:8100"),
        BackendSpec("http://10.0.0.9:8000", "http://10.0.0.9:8100"),
        BackendSpec("http://10.0.0.10:8000", "http://10.0.0.10:8100"))
    assert found.dropped == 1  # fd00::1, after the IPv4 ones
    with pytest.raises(SourceFailed, match="Name or service not known"):
        asyncio.run(source.found())
    with pytest.raises(SourceFailed, match="no usable address"):
        asyncio.run(source.found())
    assert asked == ["vllm.ns.svc"] * 3


def test_a_hanging_resolver_is_given_up_and_not_piled_up() -> None:
    started = 0
    release = asyncio.Event()

    async def hang(host: str, port: int) -> Sequence[str]:
        nonlocal started
        started += 1
        await release.wait()
        return ["10.0.0.1"]

    async def main() -> None:
        source = DnsSource(DnsName.parse("http://slow:8000"), None, 8, timeout_s=0.05,
                           resolve=hang)
        for _ in range(3):
            with pytest.raises(SourceFailed, match=r"no answer within 0\.05 s"):
                await source.found()
        assert started == 1, "one resolution out at a time"
        release.set()
        found = await source.found()
        assert [b.url for b in found.backends] == ["http://10.0.0.1:8000"]
        assert found.backends[0].node_url is None

    asyncio.run(main())


def test_the_system_resolver_reads_the_hosts_file() -> None:
    """The real getaddrinfo (off the event loop): ``localhost`` from /etc/hosts."""
    source = DnsSource(DnsName.parse("http://localhost:8123"), 8124, 8, timeout_s=5.0)
    found = asyncio.run(source.found())
    assert BackendSpec("http://127.0.0.1:8123", "http://127.0.0.1:8124") in found.backends


def test_a_fifo_as_the_backends_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO nobody writes: ``open()`` would block for ever (and a blocked read in the loop's
    default executor keeps the router from exiting); it is refused as not a regular file."""
    import os

    path = tmp_path / "backends"
    os.mkfifo(path)
    source = FileSource(path, None, 8, timeout_s=2.0)
    with pytest.raises(SourceFailed, match="not a regular file"):
        asyncio.run(asyncio.wait_for(source.found(), 1.0))


def test_a_file_read_that_hangs_is_given_up_and_not_piled_up(tmp_path: Path) -> None:
    """A read that blocks, as one on a hung network mount does (a fake: ``_read`` waits on an
    event). It is given up, not started again while it is out, and does not keep the loop
    from closing: its daemon thread is not joined."""
    import threading
    import time

    release = threading.Event()
    starts = 0

    class HungMount(FileSource):
        def _read(self) -> str:
            nonlocal starts
            starts += 1
            release.wait(30)
            return "http://10.0.0.1:8000\n"

    source = HungMount(tmp_path / "backends", None, 8, timeout_s=0.1)

    async def rounds(n: int) -> None:
        for _ in range(n):
            with pytest.raises(SourceFailed, match=r"no answer within 0\.1 s"):
                await source.found()

    began = time.monotonic()
    asyncio.run(rounds(4))
    assert time.monotonic() - began < 5, "closing the loop waited for the hung read"
    assert starts == 1, "one blocked read, not one a round"

    async def after_release() -> None:
        source._calls = type(source._calls)(2.0)  # a new loop: a fresh call
        release.set()
        found = await source.found()
        assert [b.url for b in found.backends] == ["http://10.0.0.1:8000"]
        source.close()

    asyncio.run(after_release())


@pytest.mark.parametrize("text", ["[" * 200000, "- " * 100000])
def test_a_deeply_nested_file_is_refused_not_a_recursion_error(text: str) -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_backends(text, "f", None)


def test_a_deeply_nested_file_fails_the_source(tmp_path: Path) -> None:
    path = tmp_path / "backends"
    path.write_text("[" * 200000)
    with pytest.raises(SourceFailed, match="nested too deeply"):
        asyncio.run(FileSource(path, None, 8).found())


def test_dns_answers_drop_zoned_and_link_local_and_map_ipv4() -> None:
    _asked, resolve = fixed([["fe80::1%eth0", "::ffff:10.0.0.1", "10.0.0.1", "fe80::2",
                              "169.254.169.254", "10.0.0.2"]])
    source = DnsSource(DnsName.parse("http://vllm:8000"), None, max_backends=8,
                       timeout_s=1.0, resolve=resolve)  # type: ignore[arg-type]
    found = asyncio.run(source.found())
    assert [b.url for b in found.backends] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]


def test_a_long_bad_url_does_not_show_its_credentials() -> None:
    from kvtier.router.sources import check_url

    with pytest.raises(ConfigError) as caught:
        check_url("http://user:hunter2@h:1/" + "x" * 3000, "--backend")
    assert "hunter2" not in str(caught.value)
