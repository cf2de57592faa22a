"""The one registry shape: lazy import, clear errors for unknown names and missing packages."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import BackendUnavailableError, KvtierError, UnknownBackendError
from kvtier.registry import Registry


class Base:
    pass


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module on sys.path that nothing has imported yet; removed from sys.modules after."""
    name = f"kvtier_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("class Plugin:\n    loaded = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_registered_module_is_imported_only_on_first_lookup(plugin_module: str) -> None:
    registry: Registry[Base] = Registry("widget")
    registry.register("plugin", f"{plugin_module}:Plugin")
    assert "plugin" in registry
    assert list(registry) == ["plugin"]
    assert plugin_module not in sys.modules
    cls = registry["plugin"]
    assert plugin_module in sys.modules
    assert cls.__name__ == "Plugin" and cls.loaded  # type: ignore[attr-defined]
    assert registry["plugin"] is cls


def test_an_unknown_name_lists_the_known_ones() -> None:
    registry: Registry[Base] = Registry("widget")
    registry.register("zeta", "kvtier.errors:KvtierError")
    registry.register("alpha", "kvtier.errors:KvtierError")
    with pytest.raises(UnknownBackendError) as info:
        registry["gamma"]
    assert str(info.value) == "unknown widget 'gamma'; known: alpha, zeta"
    assert isinstance(info.value, KeyError) and isinstance(info.value, KvtierError)


def test_an_empty_registry_says_none_are_known() -> None:
    with pytest.raises(UnknownBackendError, match=r"known: none$"):
        Registry[Base]("widget")["x"]


def test_a_duplicate_name_is_an_error_in_either_form() -> None:
    registry: Registry[Base] = Registry("widget")
    registry.register("a", "kvtier.errors:KvtierError")
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.register("a", "kvtier.errors:ConfigError")
    with pytest.raises(ValueError, match="already registered"):
        registry.add("a")(Base)
    assert len(registry) == 1


def test_a_missing_dependency_names_the_backend_and_the_install_hint() -> None:
    registry: Registry[Base] = Registry("tier")
    registry.register(
        "ghost", "kvtier_no_such_module_for_tests:Tier", install_hint="pip install kvtier[ghost]"
    )
    assert "ghost" in registry  # registering never imports
    with pytest.raises(BackendUnavailableError) as info:
        registry["ghost"]
    message = str(info.value)
    assert "tier 'ghost'" in message
    assert message.endswith("install it with: pip install kvtier[ghost]")
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_missing_dependency_without_a_hint_says_what_is_missing() -> None:
    registry: Registry[Base] = Registry("tier")
    registry.register("ghost", "kvtier_no_such_module_for_tests:Tier")
    with pytest.raises(BackendUnavailableError, match="kvtier_no_such_module_for_tests") as info:
        registry["ghost"]
    assert "install it with" not in str(info.value)


def test_the_decorator_registers_and_returns_the_class() -> None:
    registry: Registry[Base] = Registry("widget")

    @registry.add("mine")
    class Mine(Base):
        pass

    assert isinstance(Mine, type) and issubclass(Mine, Base)
    assert registry["mine"] is Mine
    assert dict(registry) == {"mine": Mine}
