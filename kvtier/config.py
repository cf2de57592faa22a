"""Configuration: parsed once, from YAML or a dict, into frozen dataclasses.

Every field is checked at the edge. Unknown keys and bad values raise :class:`ConfigError`
naming the key (as a dotted path) and what is allowed; nothing downstream reads raw dicts.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from kvtier.errors import ConfigError

T = TypeVar("T")

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, where: str = "size") -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size such as 4GiB or 1048576, got {value!r}")
    if isinstance(value, float):
        raise ConfigError(f"{where}: a byte count must be a whole number or a string such "
                          f"as 4GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: a size cannot be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{where}: expected a size such as 4GiB, 512MiB, 2GB or a byte count, got {value!r}"
        )
    number = float(match.group(1))
    if unit in ("", "b") and not number.is_integer():
        raise ConfigError(f"{where}: a byte count must be a whole number, got {value!r}")
    return int(number * _UNITS[unit])


def _size(default: int | None = None, **kw: Any) -> Any:
    if default is None:
        return field(metadata={"parse": parse_size}, **kw)
    return field(default=default, metadata={"parse": parse_size}, **kw)


def _optional_size(value: object, where: str) -> int | None:
    return None if value is None else parse_size(value, where)


def _admission(value: object, where: str) -> tuple[tuple[str, int], ...]:
    """``{after_uses: 2, min_priority: 50}`` (every rule must pass) or ``always``."""
    from kvtier.policies import ADMISSION

    if value in (None, "always", {}):
        return ()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of rule: value; rules: {list(ADMISSION)}")
    rules: list[tuple[str, int]] = []
    for name, param in value.items():
        if name not in ADMISSION:
            raise ConfigError(f"{where}.{name}: unknown admission rule; allowed: {list(ADMISSION)}")
        if isinstance(param, bool) or not isinstance(param, int) or param < 0:
            raise ConfigError(f"{where}.{name}: expected a non-negative integer, got {param!r}")
        if name != "always":
            rules.append((str(name), param))
    return tuple(rules)


def _eviction(value: object, where: str) -> str:
    from kvtier.policies import EVICTION

    if not isinstance(value, str) or value not in EVICTION:
        raise ConfigError(f"{where}: unknown eviction policy {value!r}; allowed: {list(EVICTION)}")
    return str(value)


@dataclass(frozen=True)
class ArenaConfig:
    """The host-RAM tier: one shared-memory region of fixed-size slots."""

    size_bytes: int = _size(1 << 30)
    slot_bytes: int = _size(4096 + (1 << 20))
    name: str | None = None
    eviction: str = field(default="lru", metadata={"parse": _eviction})
    prefault: bool = True
    free_target: float = 0.05

    def __post_init__(self) -> None:
        if self.slot_bytes < 8192 or self.slot_bytes % 4096:
            raise ConfigError("arena.slot_bytes must be a multiple of 4096 and at least 8192")
        if self.size_bytes < self.slot_bytes:
            raise ConfigError("arena.size_bytes must hold at least one slot")
        if not 0.0 <= self.free_target < 1.0:
            raise ConfigError("arena.free_target must be in [0, 1)")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", self.name):
            raise ConfigError("arena.name may use letters, digits, '_', '.', '-' (1-200 chars)")

    @property
    def num_slots(self) -> int:
        return self.size_bytes // self.slot_bytes


@dataclass(frozen=True)
class BreakerConfig:
    """When a lower tier is bypassed (see :mod:`kvtier.store.breaker`)."""

    enabled: bool = True
    errors: int = 5
    """Failures within ``window_s`` that open the breaker..."""
    error_ratio: float = 0.5
    """...provided they are at least this share of the operations in the window."""
    window_s: float = 30.0
    latency_budget_s: float = 2.0
    """An operation (one chunk's read, write or delete) slower than this is a failure."""
    cooldown_s: float = 10.0
    """An open breaker waits this long, then a probe (write, read, delete) decides."""

    def __post_init__(self) -> None:
        if self.errors < 1:
            raise ConfigError("breaker.errors must be at least 1")
        if not 0.0 <= self.error_ratio <= 1.0:
            raise ConfigError("breaker.error_ratio must be in [0, 1]")
        for name in ("window_s", "latency_budget_s", "cooldown_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"breaker.{name} must be positive")


@dataclass(frozen=True)
class TierConfig:
    """A tier below the arena. ``options`` are checked by the tier class itself."""

    type: str
    capacity_bytes: int = _size()
    name: str = ""
    eviction: str = field(default="lru", metadata={"parse": _eviction})
    admission: tuple[tuple[str, int], ...] = field(default=(), metadata={"parse": _admission})
    write_policy: Literal["through", "back"] = "through"
    io_threads: int = 2
    io_timeout_s: float = 30.0
    """A chunk read, write or delete not finished by then is given up (its waiters fail,
    the breaker counts it); the thread it hangs in is replaced."""
    keep_free_bytes: int | None = field(default=None, metadata={"parse": _optional_size})
    """Free space left to others on the backing filesystem (default: 1% of it, at least
    one chunk). The tier never promises more than the filesystem holds."""
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.io_threads <= 64:
            raise ConfigError("io_threads must be in [1, 64]")
        if self.io_timeout_s <= 0:
            raise ConfigError("io_timeout_s must be positive")
        if not self.name:
            object.__setattr__(self, "name", self.type)
        if self.name == "arena" or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", self.name):
            raise ConfigError("name must be lowercase [a-z0-9_-] (max 32) and not 'arena'")


@dataclass(frozen=True)
class ServerConfig:
    socket_path: str = ""
    arena: ArenaConfig = field(default_factory=ArenaConfig)
    tiers: tuple[TierConfig, ...] = ()
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    lease_ttl_s: float = 30.0
    orphan_grace_s: float = 10.0
    """A client that disconnects keeps its leases and reservations this long: another
    process it gave the slot numbers to (an engine worker) may still be copying."""
    max_message_bytes: int = _size(16 << 20)
    max_clients: int = 256
    """Connections beyond this are refused at once (each holds a server thread)."""
    frame_timeout_s: float = 5.0
    """A message, once its first byte arrived, must arrive whole within this time; the
    first message (the hello) within this time of connecting."""
    max_report_series: int = 1000
    """Distinct (client, event, tier) series engines may add to /metrics."""
    access_log: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"

    def __post_init__(self) -> None:
        if not self.socket_path:
            object.__setattr__(self, "socket_path", default_socket_path())
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease_ttl_s must be positive")
        if self.orphan_grace_s < 0:
            raise ConfigError("orphan_grace_s cannot be negative")
        if self.max_clients < 1 or self.max_report_series < 0 or self.frame_timeout_s <= 0:
            raise ConfigError("max_clients must be >= 1, max_report_series >= 0 and "
                              "frame_timeout_s > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError("metrics_port must be in [0, 65535] (0 picks a free port)")
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerConfig:
        return parse(cls, data, "")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ServerConfig:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping")
        return cls.from_dict(data)


def runtime_dir() -> str:
    """Where kvtier's sockets live by default: $XDG_RUNTIME_DIR or /tmp/kvtier-UID."""
    return os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.getuid()}"


def default_socket_path() -> str:
    return os.path.join(runtime_dir(), "kvtier.sock")


def parse(cls: type[T], data: object, where: str) -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    assert dataclasses.is_dataclass(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise ConfigError(
            f"{_join(where, unknown[0])}: unknown key; allowed: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        key = _join(where, name)
        custom: Callable[[object, str], Any] | None = f.metadata.get("parse")
        kwargs[name] = custom(value, key) if custom else _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc
    except ConfigError as exc:
        if where and not str(exc).startswith(where):
            raise ConfigError(f"{where}.{exc}") from exc
        raise


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _coerce(hint: Any, value: object, key: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: got {value!r}; allowed: {', '.join(map(str, args))}")
        return value
    if origin is tuple and args and _is_dataclass_type(args[0]):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list")
        return tuple(parse(args[0], item, f"{key}[{i}]") for i, item in enumerate(value))
    if _is_dataclass_type(hint):
        return parse(hint, value, key)
    if origin is not None and issubclass(origin, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping")
        return dict(value)
    return _scalar(hint, value, key)


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def _scalar(hint: Any, value: object, key: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported value {value!r}")
