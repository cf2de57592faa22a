"""redis-server on loopback (or the one address ``host``, with a password): no persistence,
optional password and memory limit.

Its settings go in a config file (mode 0600) in the working folder, so a password never shows
on a command line or in ``ps``. Nothing is saved: a stop loses every key, which is what a Redis
restart without persistence does to a cache tier.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from kvtier.errors import ConfigError
from kvtier.ports import free_ports
from kvtier.services.base import Service
from kvtier.services.binaries import REDIS_SERVER, find_binary
from kvtier.services.probes import HOST, check_host, redis_reply

EVICTION_POLICIES = ("noeviction", "allkeys-lru", "allkeys-lfu", "allkeys-random",
                     "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl")
_PLAIN = re.compile(r"[!-~]+")  # printable ASCII, no spaces
_UNSAFE_CHARS = "\"'\\"


class RedisServer(Service):
    """``redis-server`` on 127.0.0.1 (or ``host``); ``url`` for redis-py
    (``redis.Redis.from_url``)."""

    kind = "redis"

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 maxmemory: int | None = None, maxmemory_policy: str | None = None,
                 extra_config: Mapping[str, str] | None = None, workdir: Path | None = None,
                 host: str = HOST,
                 start_timeout_s: float = 15.0, stop_timeout_s: float = 10.0,
                 die_with_parent: bool = True) -> None:
        _check(password, maxmemory, maxmemory_policy, extra_config or {})
        self.host = check_host(host)  # before a working folder is made
        if not password and not ipaddress.IPv4Address(self.host).is_loopback:
            raise ConfigError(f"password: Redis on {self.host} (not loopback) would answer "
                              "anyone who reaches it (protected-mode does nothing with an "
                              "explicit bind); give a password, or bind 127.0.0.1")
        super().__init__(workdir=workdir, start_timeout_s=start_timeout_s,
                         stop_timeout_s=stop_timeout_s, die_with_parent=die_with_parent)
        self._fixed_port = port is not None
        self.port = port if port is not None else free_ports(1)[0]
        self.password = password
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.extra_config = dict(extra_config or {})
        (self.workdir / "data").mkdir(exist_ok=True)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _config_lines(self) -> list[str]:
        lines = [
            f"bind {self.host}", f"port {self.port}", "protected-mode yes", "daemonize no",
            'save ""', "appendonly no", f'dir "{self.workdir / "data"}"', 'logfile ""',
        ]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        if self.maxmemory is not None:
            lines.append(f"maxmemory {self.maxmemory}")
        if self.maxmemory_policy is not None:
            lines.append(f"maxmemory-policy {self.maxmemory_policy}")
        lines += [f"{key} {value}" for key, value in self.extra_config.items()]
        return lines

    def _command(self) -> list[str]:
        binary = find_binary(REDIS_SERVER)
        path = self.workdir / "redis.conf"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as conf:
            conf.write("\n".join(self._config_lines()) + "\n")
        return [binary, str(path)]

    def _answers(self) -> bool:
        reply = redis_reply(self.port, host=self.host)
        return reply is not None and (reply == b"+PONG" or reply.startswith(b"-NOAUTH"))

    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _new_ports(self) -> bool:
        if self._fixed_port:
            return False
        self.port = free_ports(1)[0]
        return True


def _check(password: str | None, maxmemory: int | None, policy: str | None,
           extra: Mapping[str, str]) -> None:
    if password is not None and (not _PLAIN.fullmatch(password)
                                 or any(c in password for c in _UNSAFE_CHARS)):
        raise ConfigError("password: expected printable ASCII without spaces or quotes")
    if maxmemory is not None and maxmemory <= 0:
        raise ConfigError(f"maxmemory: expected a positive byte count, got {maxmemory}")
    if policy is not None and policy not in EVICTION_POLICIES:
        raise ConfigError(f"maxmemory_policy: {policy!r} is not one of "
                          f"{', '.join(EVICTION_POLICIES)}")
    for key, value in extra.items():
        if not _PLAIN.fullmatch(key) or "\n" in value:
            raise ConfigError(f"extra_config[{key!r}]: one directive name and one line")
