"""docs/reference/config.md: every config key with its type, default and bounds, read from the
config structs (:class:`kvtier.config.ConfigStruct`): types from ``msgspec.inspect``, bounds
from the ``Meta`` the parser enforces (:mod:`kvtier.bounds`), text from the fields'
docstrings."""

from __future__ import annotations

import importlib
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, NamedTuple, get_args, get_origin

import msgspec
import msgspec.inspect as mi

from kvtier.bounds import meta_of, wording
from kvtier.reference.docstrings import field_docs
from kvtier.reference.markdown import code, page, paragraphs, prose, table


class Root(NamedTuple):
    title: str
    where: str
    """Where the user writes these keys (markdown)."""
    key: str
    """The keys' path in what the user writes (``tiers[].options``); empty at the top."""
    structs: tuple[str, ...]
    """``module:Struct``; several: one mapping accepts the keys of each."""


ROOTS = (
    Root("Node server", "The YAML file of `kvtier server --config`, and the `server:` mapping "
         "of the connector's embedded server.", "", ("kvtier.config:ServerConfig",)),
    Root("vLLM connector", "`kv_connector_extra_config` of vLLM's `--kv-transfer-config` "
         "(`kvtier serve` writes it).", "", ("kvtier.vllm.config:ConnectorConfig",)),
    Root("Per request", "`kv_transfer_params: {\"kvtier\": {...}}` of one request.",
         "", ("kvtier.vllm.config:RequestOptions",)),
)
TIER_OPTIONS = {
    "disk": ("kvtier.tiers.files:FileOptions",),
    "fs": ("kvtier.tiers.files:FileOptions", "kvtier.tiers.shared:SharingOptions"),
    "s3": ("kvtier.tiers.s3_options:S3Options", "kvtier.tiers.shared:SharingOptions"),
    "redis": ("kvtier.tiers.redis_options:RedisOptions", "kvtier.tiers.shared:SharingOptions"),
}
"""The structs of each tier type's ``options`` (tests/test_reference.py checks that every
registered tier type is here)."""
REGISTRIES = (
    ("tier types (`tiers[].type`)", "kvtier.tiers:TIERS"),
    ("eviction policies (`eviction`)", "kvtier.policies:EVICTION"),
    ("admission rules (`admission`)", "kvtier.policies:ADMISSION"),
    ("routing strategies (`kvtier route --strategy`)", "kvtier.router.strategies:STRATEGIES"),
)

INTRO = """\
Every configuration key, generated from kvtier's config classes. Sizes take a byte count or
a string such as `4GiB`, `512MiB`, `2GB`; an unknown key, a wrong type or a value out of its
bounds is refused with an error naming the key. The router is configured on its command line
(`kvtier route`, see [the command line reference](cli.md)).
"""


def render() -> str:
    sections = [section for root in ROOTS for section in _root(root)]
    for tier, structs in sorted(TIER_OPTIONS.items()):
        sections += _root(Root(f"Tier options: {tier}", f"`options` of a tier of "
                               f"`type: {tier}` in `tiers`.", "tiers[].options", structs))
    sections.append(_names())
    return page("Configuration", INTRO, sections)


def load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _root(root: Root) -> Iterator[str]:
    structs = [load(s) for s in root.structs]
    yield f"## {root.title}\n\n{root.where}"
    yield from _struct(structs, root.key, level=0)


def _struct(structs: list[type], key: str, level: int) -> Iterator[str]:
    """A table of the keys of ``structs`` (one mapping), then one section per nested struct."""
    rows: list[list[str]] = []
    nested: list[tuple[str, type]] = []
    for cls in structs:
        docs = field_docs(cls)
        raw = {f.name: f.type for f in msgspec.structs.fields(cls)}
        for field in mi.type_info(cls).fields:  # type: ignore[attr-defined]
            inner = _struct_in(field.type)
            if inner is not None:
                nested.append((field.name, inner))
            meta = meta_of(raw[field.name])
            bounds = wording(meta).removeprefix("must be ") if meta is not None else ""
            shown = _named(raw[field.name]) or _type(field.type)
            rows.append([code(field.name), shown, _default(field, inner),
                         bounds, prose(docs.get(field.name))])
    parts = []
    if level:
        intro = paragraphs(structs[0].__doc__) if len(structs) == 1 else ""
        parts.append(f"{'#' * level} {key}" + (f"\n\n{intro}" if intro else ""))
    parts.append(table(["key", "type", "default", "bounds", "description"], rows))
    yield "\n\n".join(parts)
    for name, inner in nested:
        suffix = "[]" if _is_list(structs, name) else ""
        child = f"{key}.{name}{suffix}" if key else f"{name}{suffix}"
        yield from _struct([inner], child, 3)


def _is_list(structs: list[type], name: str) -> bool:
    for cls in structs:
        for field in mi.type_info(cls).fields:  # type: ignore[attr-defined]
            if field.name == name:
                return isinstance(_strip(field.type), mi.ListType | mi.VarTupleType)
    return False


def _strip(t: Any) -> Any:
    """Without metadata and without ``| None``."""
    if isinstance(t, mi.Metadata):
        return _strip(t.type)
    if isinstance(t, mi.UnionType):
        rest = [x for x in t.types if not isinstance(x, mi.NoneType)]
        return _strip(rest[0]) if len(rest) == 1 else t
    return t


def _struct_in(t: Any) -> type | None:
    t = _strip(t)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        t = _strip(t.item_type)
    return t.cls if isinstance(t, mi.StructType) else None


_NAMES: dict[type, str] = {mi.IntType: "integer", mi.FloatType: "number", mi.StrType: "string",
          mi.BoolType: "boolean", mi.NoneType: "null", mi.AnyType: "any",
          mi.DictType: "mapping", mi.StructType: "mapping"}


def _named(hint: Any) -> str | None:
    """kvtier's own value formats (``size``), named on the annotation, ``| None`` kept."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        args = get_args(hint)
        named = [_named(a) for a in args if a is not type(None)]
        if len(named) == 1 and named[0]:
            return f"{named[0]} or null" if type(None) in args else named[0]
        return None
    if get_origin(hint) is Annotated:
        for extra in hint.__metadata__:
            found: dict[str, Any] = getattr(extra, "extra", None) or {}
            if found.get("kvtier_type"):
                return str(found["kvtier_type"])
    return None


def _type(t: Any) -> str:
    if isinstance(t, mi.Metadata):
        named = (t.extra or {}).get("kvtier_type")
        return str(named) if named else _type(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(_type(x) for x in t.types)
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(code(v) for v in t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return f"list of {_type(t.item_type)}"
    return _NAMES.get(type(t), type(t).__name__.removesuffix("Type").lower())


def _default(field: Any, inner: type | None) -> str:
    if field.required:
        return "*required*"
    if field.default_factory is not mi.NODEFAULT:
        value = field.default_factory()
        if isinstance(value, msgspec.Struct):
            return "see below"
        return code("{}" if isinstance(value, dict) else "[]")
    sized = "size" in _type(field.type) or field.name.endswith(("_bytes", "_size", "_threshold"))
    return code(_yaml(field.default, sized))


def _yaml(value: Any, sized: bool = False) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return "[" + ", ".join(map(_yaml, value)) + "]"
    if isinstance(value, str):
        return value if value else '""'
    if sized and isinstance(value, int) and value >= 1 << 20:
        return _size(value)
    return str(value)


def _size(value: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


def _names() -> str:
    rows = [[what, ", ".join(code(name) for name in load(target))]
            for what, target in REGISTRIES]
    return "## Names\n\nThe names each pluggable part accepts.\n\n" + table(
        ["part", "names"], rows)
