"""Numeric bounds of config keys, declared once on the field's type and read by everyone.

A config key's bounds are written as ``msgspec.Meta`` on its annotation::

    io_threads: Annotated[int, Meta(ge=1, le=64)] = 2
    lease_ttl_s: Positive = 30.0

``msgspec.convert`` enforces them while parsing (:func:`kvtier.config.parse` words its error
with :func:`wording`), :func:`check_bounds` enforces them on a struct built in code, and the
generated reference (:mod:`kvtier.reference`) prints them: one declaration, three readers.
Checks that relate two keys stay in the struct's ``__post_init__``.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, get_args, get_origin

import msgspec
from msgspec import Meta

from kvtier.errors import ConfigError

Positive = Annotated[float, Meta(gt=0)]
"""A number above zero (a duration, a rate)."""
NonNegative = Annotated[float, Meta(ge=0)]
"""A number of zero or more."""
Port = Annotated[int, Meta(ge=0, le=65535)]
"""A TCP port; 0 picks a free one."""

_BOUNDS = ("gt", "ge", "lt", "le")


def meta_of(hint: Any) -> Meta | None:
    """The ``Meta`` with numeric bounds on ``hint`` (``X``, ``X | None``), if any."""
    if get_origin(hint) in (typing.Union, types.UnionType):
        found = [meta_of(arg) for arg in get_args(hint) if arg is not type(None)]
        return next((m for m in found if m is not None), None)
    if get_origin(hint) is Annotated:
        for extra in hint.__metadata__:
            if isinstance(extra, Meta) and any(getattr(extra, b) is not None for b in _BOUNDS):
                return extra
    return None


def wording(meta: Meta) -> str:
    """What a value must be, in words: ``must be in [1, 64]``, ``must be positive``."""
    low = ("[", meta.ge) if meta.ge is not None else ("(", meta.gt)
    high = ("]", meta.le) if meta.le is not None else (")", meta.lt)
    if low[1] is not None and high[1] is not None:
        return f"must be in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if meta.gt == 0:
        return "must be positive"
    if low[1] is not None:
        return f"must be {'>=' if meta.ge is not None else '>'} {_num(low[1])}"
    return f"must be {'<=' if meta.le is not None else '<'} {_num(high[1])}"


def violates(meta: Meta, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False  # a type error: the parser names it
    return ((meta.gt is not None and not value > meta.gt)
            or (meta.ge is not None and not value >= meta.ge)
            or (meta.lt is not None and not value < meta.lt)
            or (meta.le is not None and not value <= meta.le))


def check_bounds(config: msgspec.Struct) -> None:
    """Raise ``ConfigError`` naming the first key of ``config`` outside its declared bounds
    (``msgspec.convert`` checks them too, but not a struct built or replaced in code)."""
    for field in msgspec.structs.fields(type(config)):
        meta = meta_of(field.type)
        value = getattr(config, field.name)
        if meta is not None and violates(meta, value):
            raise ConfigError(f"{field.name} {wording(meta)}, got {value!r}")


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
