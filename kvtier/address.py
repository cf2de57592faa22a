"""Where the node HTTP API listens, whom that exposes it to, and the address it advertises.

``metrics_host`` is the address it binds (127.0.0.1 by default); ``metrics_advertise_host``
the one others reach it at (default: ``metrics_host``), shown in ``/healthz`` (``url``) and in
what ``kvtier serve`` prints. A wildcard bind (``0.0.0.0``, ``::``) listens on every address
of the host and says nothing about which one others should use, so it needs an advertised
host, and a wildcard is never advertised.

Anything but loopback can be reached from other hosts: ``/v1/lookup`` tells whoever can
compute a prompt's keys whether it is cached. Such a bind therefore needs the node token
(``auth.http_token_env`` / ``auth.http_token_file``), unless
``auth.allow_remote_http_without_token`` says, explicitly, to answer anyone who reaches it.
"""

from __future__ import annotations

import ipaddress
from typing import Protocol

from kvtier.errors import ConfigError


class _Auth(Protocol):
    @property
    def http_token_env(self) -> str: ...
    @property
    def allow_remote_http_without_token(self) -> bool: ...


class Exposed(Protocol):
    """What of a server's configuration says where its HTTP API listens (ServerConfig)."""

    @property
    def metrics_port(self) -> int | None: ...
    @property
    def metrics_host(self) -> str: ...
    @property
    def metrics_advertise_host(self) -> str | None: ...
    @property
    def auth(self) -> _Auth: ...

LOOPBACK_NAMES = frozenset({"localhost"})
"""The one name trusted as loopback by name (``localhost.localdomain`` and the like are
whatever /etc/hosts says today: they count as reachable from elsewhere)."""


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address ``host`` is (brackets allowed; an IPv4-mapped IPv6 address counts as
    its IPv4 address), or None for a name."""
    bare = host.strip()
    if bare.startswith("[") and bare.endswith("]"):
        bare = bare[1:-1]
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_wildcard(host: str) -> bool:
    """True for a bind on every address: empty, ``0.0.0.0``, ``::`` (and ``[::]``,
    ``::ffff:0.0.0.0``)."""
    if not host.strip():
        return True
    address = _literal(host)
    return address is not None and address.is_unspecified


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or the name ``localhost``; any other
    name counts as reachable from elsewhere (what it resolves to can change)."""
    if host.strip().lower() in LOOPBACK_NAMES:
        return True
    address = _literal(host)
    return address is not None and address.is_loopback


def normal_host(host: str, key: str) -> str:
    """``host`` as a bind and a URL take it: an IP address in its canonical form (IPv6
    without brackets), ``""`` for every address, or a host name. ConfigError for anything
    else, naming ``key``: a scheme, port or path, ``*``, or a number that the C library
    would read as an address (``0``, ``0x0``, ``127.1``: write ``0.0.0.0``, ``127.0.0.1``)."""
    bare = host.strip()
    if not bare:
        return ""
    address = _literal(bare)
    if address is not None:
        return str(address)
    check_host(bare, key)
    last = bare.rstrip(".").rsplit(".", 1)[-1].lower()
    if last.isdigit() or (last.startswith("0x") and all(
            c in "0123456789abcdef" for c in last[2:])):
        raise ConfigError(f"{key}: {host!r} is read as an IP address in a short or "
                          "non-decimal form; write the address in full (e.g. 0.0.0.0, "
                          "127.0.0.1, ::1)")
    return bare


def check_host(host: str, key: str) -> None:
    """A host name or IP address literal (no scheme, port or path)."""
    if _literal(host) is not None:
        return
    labels = host.rstrip(".").split(".")
    if (not host or len(host) > 253 or any(
            not label or len(label) > 63 or not label.replace("-", "").isalnum()
            or not label.isascii() or label.startswith("-") or label.endswith("-")
            for label in labels)):
        raise ConfigError(f"{key}: expected a host name or an IP address (no scheme, port or "
                          f"path), got {host!r}")


def advertised_host(config: Exposed) -> str:
    """The host others reach the HTTP API at; ConfigError for a wildcard bind without an
    advertised host, or a wildcard advertised."""
    given = config.metrics_advertise_host
    if given is not None:
        if is_wildcard(given):
            raise ConfigError(f"metrics_advertise_host: {given!r} is not an address others "
                              "can reach; give the host's own address or name")
        check_host(given, "metrics_advertise_host")
        return given
    if is_wildcard(config.metrics_host):
        raise ConfigError(f"metrics_host {config.metrics_host!r} binds every address of this "
                          "host; set metrics_advertise_host (kvtier serve: "
                          "--kvtier-advertise-host) to the one others should use, e.g. the "
                          "pod's IP")
    return config.metrics_host


def url(host: str, port: int | str) -> str:
    """``http://HOST:PORT``, an IPv6 literal in brackets."""
    bare = host.strip("[]")
    return f"http://[{bare}]:{port}" if ":" in bare else f"http://{bare}:{port}"


def check_exposure(config: Exposed, has_token: bool) -> None:
    """Refuse a bind beyond loopback without the node token, unless explicitly allowed."""
    host = config.metrics_host
    if config.metrics_port is None or has_token or is_loopback(host):
        return
    auth = config.auth
    if auth.allow_remote_http_without_token:
        return
    raise ConfigError(
        f"metrics_host {host!r} is not loopback: other hosts could ask /v1/lookup and "
        f"/v1/namespaces which prompts are cached; set the node token "
        f"(${auth.http_token_env} or auth.http_token_file; kvtier serve: --node-token-file) "
        "or, to answer anyone who reaches it, auth.allow_remote_http_without_token: true "
        "(kvtier serve: --allow-remote-http-without-token)")
