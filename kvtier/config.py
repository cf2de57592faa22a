"""Configuration: parsed once, from YAML or a dict, into frozen msgspec structs.

:func:`parse` builds a :class:`ConfigStruct` with ``msgspec.convert``, strict about types
(``"9100"`` is no integer, ``1`` is not ``true``); ``__post_init__`` checks values and turns
kvtier's own formats (sizes such as ``"4GiB"``, admission rules) into typed ones. Its
``ConfigError`` starts with a key relative to its struct (``"slot_bytes must be ..."``) and
``parse`` puts the struct's path in front, so every error names the dotted key and what is
allowed: ``tiers[0].options.pathh: unknown key; allowed: dir_fsync, fsync, o_direct, path``.
A tier parses its ``options`` alike::

    class S3Options(ConfigStruct, frozen=True):
        bucket: str

    self.options = parse(S3Options, config.options, f"{name}.options")
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec
import yaml

from kvtier.address import advertised_host, normal_host
from kvtier.bounds import NonNegative, Port, Positive, check_bounds, meta_of, wording
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    Size = int
    AdmissionRules = tuple[tuple[str, int], ...]
else:  # decoded as given; __post_init__ turns them into the types above
    Size = Annotated[Any, msgspec.Meta(extra={"kvtier_type": "size"})]
    AdmissionRules = Annotated[Any, msgspec.Meta(extra={"kvtier_type": "admission rules"})]

C = TypeVar("C", bound="ConfigStruct")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigStruct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every config type: frozen, and unknown keys are errors. Subclasses repeat
    ``frozen=True`` for mypy; ``msgspec.structs.replace`` runs ``__post_init__`` again."""


def parse_size(value: object, where: str = "size") -> int:
    """Bytes from an int or a string such as ``"4GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool | float):
        raise ConfigError(f"{where}: expected a size such as 4GiB or a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: a size cannot be negative, got {value}")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{where}: expected a size such as 4GiB, 512MiB, 2GB or a byte count, got {value!r}"
        )
    number = float(match.group(1))
    if unit in ("", "b") and not number.is_integer():
        raise ConfigError(f"{where}: a byte count must be a whole number, got {value!r}")
    return int(number * _UNITS[unit])


def _admission(value: object, where: str = "admission") -> tuple[tuple[str, int], ...]:
    """``{after_uses: 2, min_priority: 50}`` (every rule must pass), ``always``, or parsed pairs."""
    from kvtier.policies import ADMISSION

    if value in (None, "always", {}, ()):
        return ()
    rules = dict(value) if isinstance(value, tuple) else value
    if not isinstance(rules, Mapping):
        raise ConfigError(f"{where}: expected a mapping of rule: value; rules: {list(ADMISSION)}")
    parsed: list[tuple[str, int]] = []
    for name, param in rules.items():
        if name not in ADMISSION:
            raise ConfigError(f"{where}.{name}: unknown admission rule; allowed: {list(ADMISSION)}")
        if isinstance(param, bool) or not isinstance(param, int) or param < 0:
            raise ConfigError(f"{where}.{name}: expected a non-negative integer, got {param!r}")
        if name != "always":
            parsed.append((str(name), param))
    return tuple(parsed)


def _check_eviction(name: str) -> None:
    from kvtier.policies import EVICTION

    if name not in EVICTION:
        raise ConfigError(f"eviction: unknown eviction policy {name!r}; allowed: {list(EVICTION)}")


def _sizes(config: ConfigStruct, *names: str) -> None:
    for name in names:
        msgspec.structs.force_setattr(config, name, parse_size(getattr(config, name), name))


class ArenaConfig(ConfigStruct, frozen=True):
    """The host-RAM tier: one shared-memory region of fixed-size slots."""

    size_bytes: Size = 1 << 30
    """Host RAM for the arena, allocated (and pre-faulted) at startup."""
    slot_bytes: Size = 4096 + (1 << 20)
    """One chunk per slot: the 4096-byte header and the payload; a multiple of 4096, at
    least 8192 (the connector sizes it from the model when it embeds the server)."""
    name: str | None = None
    """The shared-memory name; default ``kvtier-arena-UID-PID-RANDOM``."""
    eviction: str = "lru"
    """The arena's eviction policy (see Names below)."""
    prefault: bool = True
    """Touch every page at startup, so the first requests do not pay for page faults."""
    free_target: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.05
    """Share of slots kept free: write-back tiers are written ahead of need."""

    def __post_init__(self) -> None:
        check_bounds(self)
        _sizes(self, "size_bytes", "slot_bytes")
        _check_eviction(self.eviction)
        if self.slot_bytes < 8192 or self.slot_bytes % 4096:
            raise ConfigError("slot_bytes must be a multiple of 4096 and at least 8192")
        if self.size_bytes < self.slot_bytes:
            raise ConfigError("size_bytes must hold at least one slot")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,200}", self.name):
            raise ConfigError("name may use letters, digits, '_', '.', '-' (1-200 chars)")

    @property
    def num_slots(self) -> int:
        return self.size_bytes // self.slot_bytes


class BreakerConfig(ConfigStruct, frozen=True):
    """When a lower tier is bypassed (see :mod:`kvtier.store.breaker`)."""

    enabled: bool = True
    """Whether failures bypass the tier at all."""
    errors: Annotated[int, msgspec.Meta(ge=1)] = 5
    """Failures within ``window_s`` that open the breaker..."""
    error_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    """...provided they are at least this share of the operations in the window."""
    window_s: Positive = 30.0
    """The window failures are counted in."""
    latency_budget_s: Positive = 2.0
    """An operation (one chunk's read, write or delete) slower than this is a failure."""
    cooldown_s: Positive = 10.0
    """An open breaker waits this long, then a probe (write, read, delete) decides."""

    def __post_init__(self) -> None:
        check_bounds(self)


class TierConfig(ConfigStruct, frozen=True):
    """A tier below the arena. ``options`` are checked by the tier class itself."""

    type: str
    """The tier type (see Names below); its ``options`` are in the sections below."""
    capacity_bytes: Size
    """kvtier never lets the tier grow past this."""
    name: str = ""
    """Used in metrics and lookups; default: the type."""
    eviction: str = "lru"
    admission: AdmissionRules = ()
    """Rules a chunk must all pass to be written here, e.g. ``{after_uses: 2,
    min_priority: 50}``; ``always`` (the default) or ``{}`` admits every chunk."""
    write_policy: Literal["through", "back"] = "through"
    """``through``: written once stored in the arena (needed for sharing); ``back``:
    written when the arena evicts it."""
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    """Threads doing this tier's chunk I/O."""
    io_timeout_s: Positive = 30.0
    """A chunk read, write or delete not finished by then is given up (its waiters fail,
    the breaker counts it); the thread it hangs in is replaced."""
    keep_free_bytes: Size | None = None
    """Free space left to others on the backing filesystem (default: 1% of it, at least
    one chunk). The tier never promises more than the filesystem holds."""
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    options: Mapping[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        check_bounds(self)
        _sizes(self, "capacity_bytes")
        if self.keep_free_bytes is not None:
            _sizes(self, "keep_free_bytes")
        _check_eviction(self.eviction)
        msgspec.structs.force_setattr(self, "admission", _admission(self.admission))
        if not self.name:
            msgspec.structs.force_setattr(self, "name", self.type)
        if self.name == "arena" or not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", self.name):
            raise ConfigError("name must be lowercase [a-z0-9_-] (max 32) and not 'arena'")


class AuthConfig(ConfigStruct, frozen=True):
    """Where a server finds its secrets: environment variables or owner-only files, never
    the config itself (docs/security.md)."""

    shared_secret_env: str = "KVTIER_SHARED_SECRET"
    """The cluster secret(s) that sign and check chunks and notes of shared tiers; several,
    separated by commas: the first signs, all are accepted."""
    shared_secret_file: str | None = None
    """Instead of the variable: a file (mode 600) with one secret per line."""
    http_token_env: str = "KVTIER_NODE_TOKEN"
    """The bearer token the node HTTP API asks of ``/v1/lookup``, ``/v1/namespaces`` and
    ``/v1/stats``; unset: those answer anyone on the bound address."""
    http_token_file: str | None = None
    """Instead of the variable: a file (mode 600) holding the token."""
    metrics_need_token: bool = False
    """Whether ``/metrics`` asks for the token too."""
    allow_remote_http_without_token: bool = False
    """Let the HTTP API bind an address beyond loopback (``metrics_host``) without a token,
    answering anyone who reaches it; without this such a bind is refused
    (:mod:`kvtier.address`)."""


MAX_QUOTA_TENANTS = 1024


class QuotaConfig(ConfigStruct, frozen=True):
    """``retention_quotas``: the bytes a tenant may hold above the default retention priority
    in each tier (``arena`` or a lower tier's name; a tier not named: no limit). A request
    names its tenant in ``kv_transfer_params.kvtier.tenant`` (the router sets it); one
    without is tenant ``default``, and tenants not listed share ``others``."""

    tenants: dict[str, dict[str, Size]] = msgspec.field(default_factory=dict)
    others: dict[str, Size] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.tenants) > MAX_QUOTA_TENANTS:
            raise ConfigError(f"tenants: at most {MAX_QUOTA_TENANTS} tenants, got "
                              f"{len(self.tenants)}")
        for name, limits in [*self.tenants.items(), ("others", self.others)]:
            where = "others" if limits is self.others else f"tenants.{name}"
            for tier in list(limits):
                limits[tier] = parse_size(limits[tier], f"{where}.{tier}")

    def check_tiers(self, names: Iterable[str]) -> None:
        allowed = sorted(names)
        for name, limits in [*self.tenants.items(), ("others", self.others)]:
            unknown = set(limits) - set(allowed)
            if unknown:
                raise ConfigError(f"retention_quotas: {name}: unknown tier(s) "
                                  f"{sorted(unknown)}; allowed: {allowed}")

    def warnings(self, capacities: Mapping[str, int]) -> list[str]:
        """What a server with these tiers should say at start: a quota beyond its tier's
        capacity (no limit in effect; allowed, as pods sized differently share one config),
        and a tier whose quotas add up to more than it holds (allowed: tenants rarely pin at
        once; there a tenant's chunks retained within its quota may give way to another's
        retained within theirs)."""
        said: list[str] = []
        total: dict[str, int] = {}
        for name, limits in [*self.tenants.items(), ("others", self.others)]:
            for tier, limit in limits.items():
                total[tier] = total.get(tier, 0) + int(limit)
                if limit > capacities[tier]:
                    said.append(f"retention_quotas: {name}.{tier} is {limit} bytes, more than "
                                f"the tier holds ({capacities[tier]} bytes): no limit there "
                                "in effect")
        for tier, n in total.items():
            if n > capacities[tier]:
                said.append(f"retention_quotas: the quotas in tier {tier} add up to {n} bytes, "
                            f"more than it holds ({capacities[tier]}): there a tenant's chunks "
                            "retained within its quota may give way to another's retained "
                            "within theirs")
        return said


class ServerConfig(ConfigStruct, frozen=True):
    """A node server: its socket, secrets, arena and lower tiers, HTTP API and limits."""

    socket_path: str = ""
    """The unix socket clients connect to; empty: ``kvtier.sock`` in ``$XDG_RUNTIME_DIR``
    (else ``/tmp/kvtier-UID``)."""
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    arena: ArenaConfig = msgspec.field(default_factory=ArenaConfig)
    tiers: tuple[TierConfig, ...] = ()
    metrics_port: Port | None = None
    """The node HTTP API's port (0 picks a free one); unset: no HTTP API."""
    metrics_host: str = "127.0.0.1"
    """The address the HTTP API binds; beyond loopback only with the node token (``auth``)."""
    metrics_advertise_host: str | None = None
    """The address others reach the HTTP API at (``/healthz``'s ``url``); default
    ``metrics_host``, required when that is a wildcard (0.0.0.0, ::)."""
    lease_ttl_s: Positive = 30.0
    """Leases and reservations of a client that stays silent expire after this."""
    orphan_grace_s: NonNegative = 10.0
    """A client that disconnects keeps its leases and reservations this long: another
    process it gave the slot numbers to (an engine worker) may still be copying."""
    max_message_bytes: Size = 16 << 20
    """A larger control message is refused and its client disconnected."""
    max_clients: Annotated[int, msgspec.Meta(ge=1)] = 256
    """Connections beyond this are refused at once (each holds a server thread)."""
    frame_timeout_s: Positive = 5.0
    """A message, once its first byte arrived, must arrive whole within this time; the
    first message (the hello) within this time of connecting."""
    max_report_series: Annotated[int, msgspec.Meta(ge=0)] = 1000
    """Distinct (client, event, tier) series engines may add to /metrics."""
    access_log: str | None = None
    """A JSON-lines file of lookups, read by ``kvtier trace``."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    retention_quotas: QuotaConfig | None = None
    """Bytes per tenant and tier held above the default priority (:class:`QuotaConfig`)."""

    def __post_init__(self) -> None:
        check_bounds(self)
        _sizes(self, "max_message_bytes")
        if not self.socket_path:
            msgspec.structs.force_setattr(self, "socket_path", default_socket_path())
        if self.metrics_port is not None:
            msgspec.structs.force_setattr(
                self, "metrics_host", normal_host(self.metrics_host, "metrics_host"))
            if self.metrics_advertise_host is not None:
                msgspec.structs.force_setattr(self, "metrics_advertise_host", normal_host(
                    self.metrics_advertise_host, "metrics_advertise_host"))
            advertised_host(self)
        names = [tier.name for tier in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers: names must be unique, got {names}")
        if self.retention_quotas is not None:
            self.retention_quotas.check_tiers({"arena", *names})

    def capacities(self) -> dict[str, int]:
        """Bytes each tier holds, by name (``arena``: its whole slots, and the lower
        tiers)."""
        return {"arena": self.arena.num_slots * int(self.arena.slot_bytes),
                **{tier.name: int(tier.capacity_bytes) for tier in self.tiers}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServerConfig:
        return parse(cls, data)

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


def parse(cls: type[C], data: object, where: str = "") -> C:
    """Build config type ``cls`` from ``data``; ``where`` (``"tiers[0].options"``), the path
    of ``data`` in the user's configuration, starts every error's key."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, cls, data, where)) from exc


# msgspec's messages end in " - at `$.tiers[0].options`" (or "`key` in `$...`" for a key)
_AT = re.compile(r"(?P<detail>.*?)(?: - at (?P<in_key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_BOUND = re.compile(r"Expected `[^`]*` (?:>=|<=|>|<) \S+")
_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "object": "a mapping", "array": "a list", "null": "null"}


def _explain(exc: msgspec.ValidationError, cls: type, data: object, where: str) -> str:
    """kvtier's wording of a msgspec error: the dotted key, then what is wrong or allowed."""
    at = _AT.fullmatch(str(exc))
    assert at is not None  # every string matches: the location is optional
    path = at["path"] or ""
    key = f"{where}{path}".removeprefix(".")
    detail, here = at["detail"], key or "config"
    if isinstance(exc.__cause__, ConfigError):  # raised by a __post_init__
        return _join(key, str(exc.__cause__))
    if at["in_key"]:
        return f"{here}: keys must be strings"
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", detail):
        fields = sorted(f.name for f in msgspec.structs.fields(_type_at(cls, path)))
        return f"{_join(key, unknown[1])}: unknown key; allowed: {', '.join(fields)}"
    if _BOUND.fullmatch(detail) and (meta := meta_of(_field_type(cls, path))) is not None:
        return f"{here} {wording(meta)}, got {_value_at(data, path)!r}"
    if missing := re.fullmatch(r"Object missing required field `(.*)`", detail):
        return f"{here}: missing required key {missing[1]}"
    if expected := re.fullmatch(r"Expected `(.*?)`, got `.*`", detail):
        wanted = " or ".join(_WORDS.get(name, name) for name in expected[1].split(" | "))
        return f"{here}: expected {wanted}, got {_value_at(data, path)!r}"
    if detail.startswith("Invalid enum value"):
        allowed = ", ".join(map(str, get_args(_type_at(cls, path))))
        return f"{here}: got {_value_at(data, path)!r}; allowed: {allowed}"
    return f"{here}: {detail}"


def _join(key: str, rest: str) -> str:
    return f"{key}.{rest}" if key else rest


def _type_at(cls: type, path: str) -> Any:
    """The declared type at ``path`` (``.tiers[0].write_policy``) inside config type ``cls``."""
    hint: Any = cls
    for name, _index in _STEP.findall(path):
        hint = _not_none(hint)
        if name:
            hint = {f.name: f.type for f in msgspec.structs.fields(hint)}[name]
        else:
            hint = get_args(hint)[0]  # tuple[X, ...]
    return _not_none(hint)


def _field_type(cls: type, path: str) -> Any:
    """The declared type of the field at ``path``, its ``Annotated`` bounds kept."""
    parent, _, name = path.rpartition(".")
    fields = {f.name: f.type for f in msgspec.structs.fields(_type_at(cls, parent))}
    return fields.get(name)


def _not_none(hint: Any) -> Any:  # X | None -> X, Annotated[X, ...] -> X
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    if isinstance(hint, types.UnionType) or get_origin(hint) is Union:
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
        return _not_none(hint)
    return hint


def _value_at(data: Any, path: str) -> Any:
    for name, index in _STEP.findall(path):
        data = data[name] if name else data[int(index)]
    return data
