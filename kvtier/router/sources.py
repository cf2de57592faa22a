"""Where discovered backends come from: the A/AAAA records of a DNS name, or a watched file.

Both answer :meth:`Source.found` with the backends to route to now (each with its node
server, when one is known), or raise :class:`SourceFailed`: the caller then keeps the last
good set. What either says is hostile input: every URL is checked, and at most
``max_backends`` are taken (the rest are counted in :attr:`Found.dropped`).

DNS (a Kubernetes headless Service): ``http://NAME:PORT`` becomes ``http://ADDRESS:PORT`` for
each address the system resolver (``getaddrinfo``: cluster DNS, ``/etc/hosts``) gives for
NAME, resolved off the event loop and given up after ``timeout_s``. A name with no address
fails like one that does not resolve.

A file (bare metal, Slurm) holds one backend per line (``#`` starts a comment; an optional
second column is its node server's URL), or a YAML/JSON list of URLs or of ``{url, node}``
mappings. A file that is missing, empty (a writer caught half-way), over :data:`MAX_FILE_BYTES`,
or wrong anywhere fails whole. A file with only comments means: no backends.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from kvtier.errors import ConfigError
from kvtier.router.redact import redact_url

MAX_FILE_BYTES = 1 << 20
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


# ---------------------------------------------------------------------- URLs

def host_url(scheme: str, host: str, port: int) -> str:
    bare = host.strip("[]")
    return f"{scheme}://[{bare}]:{port}" if ":" in bare else f"{scheme}://{bare}:{port}"


def check_url(raw: str, what: str) -> str:
    """An ``http(s)://HOST[:PORT]`` base URL, without credentials, query or fragment; the
    normalised form (no trailing slash). ConfigError names ``what`` and the problem."""
    if not isinstance(raw, str) or not raw.strip() or len(raw) > 2048:
        raise ConfigError(f"{what}: expected an http(s)://HOST:PORT URL, got {raw!r:.80}")
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
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
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
        self._pending: asyncio.Task[Sequence[str]] | None = None
        """A resolution that outlived its timeout: not started again until it ends (a
        hanging resolver must not pile up threads)."""

    async def found(self) -> Found:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self.resolve(self.name.name, self.name.port))
        try:
            raw = await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
        except TimeoutError:
            raise SourceFailed(f"no answer within {self.timeout_s:g} s") from None
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
    """Unique unicast addresses, sorted (a stable order whatever the resolver's); an IPv6
    zone (``fe80::1%eth0``) is dropped with its address."""
    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for item in raw:
        try:
            address = ipaddress.ip_address(str(item))
        except ValueError:
            continue
        if address.is_unspecified or address.is_multicast or (
                isinstance(address, ipaddress.IPv4Address)
                and address == ipaddress.IPv4Address("255.255.255.255")):
            continue
        out.add(address)
    return [str(a) for a in sorted(out, key=lambda a: (a.version, int(a)))]


# ---------------------------------------------------------------------- a file

class FileSource:
    def __init__(self, path: Path, node_port: int | None, max_backends: int) -> None:
        self.path = path
        self.node_port = node_port
        self.max_backends = max_backends
        self.what = f"file {path}"

    async def found(self) -> Found:
        text = await asyncio.to_thread(self._read)
        try:
            specs = parse_backends(text, "", self.node_port)
        except ConfigError as exc:
            raise SourceFailed(str(exc)) from None
        return _bounded(specs, self.max_backends)

    def _read(self) -> str:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SourceFailed(f"cannot read it: {exc.strerror or exc}") from None
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
