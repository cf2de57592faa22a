"""Where discovered backends come from: the A/AAAA records of a DNS name, or a watched file.

Both answer :meth:`Source.found` with the backends to route to now (each with its node
server, when one is known), or raise :class:`SourceFailed`: the caller then keeps the last
good set. What either says is hostile input: every URL is checked, and at most
``max_backends`` are taken (the rest are counted in :attr:`Found.dropped`).

DNS (a Kubernetes headless Service): ``http://NAME:PORT`` becomes ``http://ADDRESS:PORT`` for
each address the system resolver (``getaddrinfo``: cluster DNS, ``/etc/hosts``) gives for
NAME, resolved off the event loop and given up after ``timeout_s`` (a file's read too:
:class:`OneAtATime`). A name with no address fails like one that does not resolve.

A file (bare metal, Slurm) holds one backend per line (``#`` starts a comment; an optional
second column is its node server's URL), or a YAML/JSON list of URLs or of ``{url, node}``
mappings. A file that is missing, not a regular file (a FIFO), empty (a writer caught
half-way), over :data:`MAX_FILE_BYTES`, nested deeper than a list of mappings,
or wrong anywhere fails whole. A file with only comments means: no backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import stat
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

import yaml

from kvtier.errors import ConfigError
from kvtier.router.redact import redact_url

MAX_FILE_BYTES = 1 << 20
T = TypeVar("T")
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port) -> addresses``: :func:`system_resolve`, or a test's own."""


class SourceFailed(Exception):
    """The source could not say who the backends are now (the message says why)."""


@dataclass(frozen=True)
class BackendSpec:
    url: str
    node_url: str | None = None


@dataclass(frozen=True)
class Found:
    backends: tuple[BackendSpec, ...]
    dropped: int = 0
    """Backends left out: over the source's ``max_backends``."""


class Source(Protocol):
    what: str
    """For log lines: ``DNS name NAME`` / ``file PATH``."""

    async def found(self) -> Found: ...

    def close(self) -> None:
        """Give up what is still out (the router stops)."""


class OneAtATime(Generic[T]):
    """A blocking call (a resolution, a read on a network filesystem) run off the event loop,
    waited for at most ``timeout_s``; one that outlived its timeout is not started again
    until it ends, so a hanging resolver or mount cannot pile up threads."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: asyncio.Future[T] | None = None

    async def run(self, start: Callable[[], Awaitable[T]]) -> T:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(start())
            self._pending.add_done_callback(_retrieved)
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
        except TimeoutError:
            raise SourceFailed(f"no answer within {self.timeout_s:g} s") from None

    def close(self) -> None:
        if self._pending is not None:
            self._pending.cancel()


def in_daemon_thread(call: Callable[[], T]) -> Awaitable[T]:
    """``call()`` in a daemon thread of its own, awaited. Unlike ``asyncio.to_thread`` (the
    loop's default executor, joined when the loop closes) a call that never returns (a hung
    mount or resolver) cannot keep the router from exiting."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(value)  # type: ignore[arg-type]

    def work() -> None:
        try:
            value, exc = call(), None
        except BaseException as caught:  # handed to the awaiting task
            value, exc = None, caught
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, value, exc)

    threading.Thread(target=work, name="kvtier-source", daemon=True).start()
    return future


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A call given up on may fail later: its exception is read here (the poll that
    waited for it has already said why it failed)."""
    if not future.cancelled():
        future.exception()


# ---------------------------------------------------------------------- URLs

def host_url(scheme: str, host: str, port: int) -> str:
    bare = host.strip("[]")
    return f"{scheme}://[{bare}]:{port}" if ":" in bare else f"{scheme}://{bare}:{port}"


def check_url(raw: str, what: str) -> str:
    """An ``http(s)://HOST[:PORT]`` base URL, without credentials, query or fragment; the
    normalised form (no trailing slash). ConfigError names ``what`` and the problem."""
    if not isinstance(raw, str) or not raw.strip() or len(raw) > 2048:
        shown = redact_url(raw) if isinstance(raw, str) else raw
        raise ConfigError(f"{what}: expected an http(s)://HOST:PORT URL, got {shown!r:.80}")
    try:
        parts = urlsplit(raw.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{what}: {redact_url(raw)!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what}: {redact_url(raw)!r} is not an http(s)://HOST:PORT URL")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{what}: {redact_url(raw)!r} carries credentials; discovered "
                          "backends take none (use --backend-api-key-* / --node-token-*)")
    if parts.query or parts.fragment:
        raise ConfigError(f"{what}: {redact_url(raw)!r}: no query or fragment allowed")
    del port  # checked above: a port out of range raises
    return raw.strip().rstrip("/")


def node_of(url: str, node_port: int | None) -> str | None:
    """A backend's node server by convention: the same host, ``node_port``, plain http."""
    if node_port is None:
        return None
    host = urlsplit(url).hostname
    assert host is not None  # check_url saw to it
    return host_url("http", host, node_port)


def _bounded(specs: Sequence[BackendSpec], most: int) -> Found:
    return Found(tuple(specs[:most]), max(0, len(specs) - most))


# ---------------------------------------------------------------------- DNS

@dataclass(frozen=True)
class DnsName:
    """``--backends-dns http://NAME:PORT``, checked."""

    scheme: str
    name: str
    port: int

    @classmethod
    def parse(cls, raw: str) -> DnsName:
        url = check_url(raw, "--backends-dns")
        parts = urlsplit(url)
        if parts.path not in ("", "/"):
            raise ConfigError(f"--backends-dns: {raw!r}: no path allowed (give "
                              "http://NAME:PORT)")
        if parts.port is None:
            raise ConfigError(f"--backends-dns: {raw!r}: give the backends' port "
                              "(http://NAME:PORT)")
        assert parts.hostname is not None
        return cls(parts.scheme, parts.hostname, parts.port)


async def system_resolve(host: str, port: int) -> Sequence[str]:
    """The system resolver (getaddrinfo: /etc/hosts, cluster DNS), in a worker thread."""
    infos = await in_daemon_thread(
        lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
    return [str(info[4][0]) for info in infos]


class DnsSource:
    def __init__(self, name: DnsName, node_port: int | None, max_backends: int,
                 timeout_s: float, resolve: Resolver = system_resolve) -> None:
        self.name = name
        self.node_port = node_port
        self.max_backends = max_backends
        self.timeout_s = timeout_s
        self.resolve = resolve
        self.what = f"DNS name {name.name}"
        self._calls: OneAtATime[Sequence[str]] = OneAtATime(timeout_s)

    def close(self) -> None:
        self._calls.close()

    async def found(self) -> Found:
        try:
            raw = await self._calls.run(lambda: self.resolve(self.name.name, self.name.port))
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            raise SourceFailed(f"{type(exc).__name__}: {exc}") from None
        addresses = _addresses(raw)
        if not addresses:
            raise SourceFailed("it has no usable address")
        specs = []
        for address in addresses:
            url = host_url(self.name.scheme, address, self.name.port)
            specs.append(BackendSpec(url, node_of(url, self.node_port)))
        return _bounded(specs, self.max_backends)


def _addresses(raw: Sequence[str]) -> list[str]:
    """Unique unicast addresses, sorted (a stable order whatever the resolver's). An
    IPv4-mapped IPv6 address counts as its IPv4 address; an address with an IPv6 zone
    (``fe80::1%eth0``) and a link-local one (``169.254.169.254``, a cloud's metadata
    endpoint, would be sent the backend key and node token) are dropped."""
    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for item in raw:
        try:
            address = ipaddress.ip_address(str(item))
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address):
            if address.scope_id is not None:
                continue
            if address.ipv4_mapped is not None:
                address = address.ipv4_mapped
        if address.is_unspecified or address.is_multicast or address.is_link_local or (
                isinstance(address, ipaddress.IPv4Address)
                and address == ipaddress.IPv4Address("255.255.255.255")):
            continue
        out.add(address)
    return [str(a) for a in sorted(out, key=lambda a: (a.version, int(a)))]


# ---------------------------------------------------------------------- a file

class FileSource:
    def __init__(self, path: Path, node_port: int | None, max_backends: int,
                 timeout_s: float = 2.0) -> None:
        self.path = path
        self.node_port = node_port
        self.max_backends = max_backends
        self.what = f"file {path}"
        self._calls: OneAtATime[str] = OneAtATime(timeout_s)

    def close(self) -> None:
        self._calls.close()

    async def found(self) -> Found:
        text = await self._calls.run(lambda: in_daemon_thread(self._read))
        try:
            specs = parse_backends(text, "", self.node_port)
        except ConfigError as exc:
            raise SourceFailed(str(exc)) from None
        return _bounded(specs, self.max_backends)

    def _read(self) -> str:
        """The file's text; opened without blocking (a FIFO or device named here would
        block ``open()``) and refused unless it is a regular file."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SourceFailed(f"cannot read it: {exc.strerror or exc}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SourceFailed("not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SourceFailed(f"cannot read it: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if len(raw) > MAX_FILE_BYTES:
            raise SourceFailed(f"over {MAX_FILE_BYTES} bytes")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceFailed(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None


def parse_backends(text: str, where: str, node_port: int | None) -> list[BackendSpec]:
    """The backends a file lists (see the module docstring); ConfigError names the line or
    item that is wrong (after ``where``, the file's name, if given) and what is allowed.
    Repeated URLs count once."""
    if not text.strip():
        raise ConfigError(_at(where, "empty (a file with only '#' comments means no "
                                     "backends)"))
    first = next((line.strip() for line in text.splitlines()
                  if line.strip() and not line.strip().startswith("#")), "")
    if first.startswith(("[", "-")):
        specs = _structured(text, where, node_port)
    else:
        specs = _lines(text, where, node_port)
    seen: dict[str, BackendSpec] = {}
    for spec in specs:
        seen.setdefault(spec.url, spec)
    return list(seen.values())


def _lines(text: str, where: str, node_port: int | None) -> list[BackendSpec]:
    specs = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        at = _at(where, f"line {number}")
        if len(fields) > 2:
            raise ConfigError(f"{at}: expected 'URL [NODE_URL]', got {len(fields)} fields")
        url = check_url(fields[0], at)
        node = check_url(fields[1], f"{at} (node server)") if len(fields) == 2 else None
        specs.append(BackendSpec(url, node or node_of(url, node_port)))
    return specs


def _structured(text: str, where: str, node_port: int | None) -> list[BackendSpec]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(_at(where, f"not YAML/JSON: {exc}")) from None
    except RecursionError:
        raise ConfigError(_at(where, "nested too deeply (expected a flat list of URLs or "
                                     "{url, node} mappings)")) from None
    except Exception as exc:  # any parser failure is the file's fault
        raise ConfigError(_at(where, f"not YAML/JSON: {type(exc).__name__}: {exc}")) from None
    if not isinstance(doc, list):
        raise ConfigError(_at(where, "expected a list of URLs or {url, node} mappings"))
    return [_item(item, f"{where}[{i}]" if where else f"item {i}", node_port)
            for i, item in enumerate(doc)]


def _at(where: str, what: str) -> str:
    return f"{where} {what}" if where and what.startswith("line") else (
        f"{where}: {what}" if where else what)


def _item(item: Any, at: str, node_port: int | None) -> BackendSpec:
    if isinstance(item, str):
        url = check_url(item, at)
        return BackendSpec(url, node_of(url, node_port))
    if not isinstance(item, dict):
        raise ConfigError(f"{at}: expected a URL or a {{url, node}} mapping")
    unknown = sorted(str(k) for k in item if k not in ("url", "node"))
    if unknown:
        raise ConfigError(f"{at}: unknown key {unknown[0]!r}; allowed: url, node")
    if "url" not in item:
        raise ConfigError(f"{at}: missing key url")
    url = check_url(item["url"], f"{at}.url")
    node = item.get("node")
    return BackendSpec(url, check_url(node, f"{at}.node") if node is not None
                       else node_of(url, node_port))
