"""One registry shape for every pluggable thing: a name maps to a lazily imported class.

Built-in entries are ``"package.module:Attr"`` strings, imported on first use, so an optional
dependency is only needed when its backend is chosen. A duplicate name is an error; an unknown
name lists the known ones; a missing dependency says what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from kvtier.errors import BackendUnavailableError, UnknownBackendError

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    target: str | object
    install_hint: str | None


class Registry(Generic[T], Mapping[str, type[T]]):
    """A read-only mapping ``name -> class`` whose classes are imported on first access."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, _Entry] = {}
        self._loaded: dict[str, type[T]] = {}

    def register(self, name: str, target: str, *, install_hint: str | None = None) -> None:
        """Register ``name`` as the dotted path ``"pkg.module:Class"``."""
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target must look like 'pkg.module:Class'")
        self._add(name, _Entry(target, install_hint))

    def add(self, name: str) -> Callable[[type[T]], type[T]]:
        """Decorator form for classes defined in-tree or by plugins; returns the class."""

        def decorator(cls: type[T]) -> type[T]:
            self._add(name, _Entry(cls, None))
            return cls

        return decorator

    def _add(self, name: str, entry: _Entry) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def __getitem__(self, name: str) -> type[T]:
        if name in self._loaded:
            return self._loaded[name]
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            raise UnknownBackendError(f"unknown {self.kind} {name!r}; known: {known}")
        cls = entry.target if not isinstance(entry.target, str) else self._import(name, entry)
        self._loaded[name] = cast("type[T]", cls)
        return self._loaded[name]

    def _import(self, name: str, entry: _Entry) -> object:
        module_name, _, attr = cast(str, entry.target).partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; install it with: {entry.install_hint}" if entry.install_hint else ""
            raise BackendUnavailableError(
                f"{self.kind} {name!r} needs a package that is missing ({exc}){hint}"
            ) from exc
        try:
            return getattr(module, attr)
        except AttributeError as exc:
            raise BackendUnavailableError(
                f"{self.kind} {name!r}: module {module_name} has no attribute {attr!r}"
            ) from exc

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
