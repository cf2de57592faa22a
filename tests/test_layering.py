"""The core imports neither vLLM nor torch (DESIGN: dependencies point one way)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = [
    "kvtier.errors", "kvtier.config", "kvtier.registry", "kvtier.keys", "kvtier.codec",
    "kvtier.policies", "kvtier.tiers", "kvtier.tiers.disk", "kvtier.tiers.arena",
    "kvtier.store", "kvtier.server", "kvtier.client", "kvtier.cli",
]


def test_core_runs_with_vllm_and_torch_blocked() -> None:
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'torch'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"for m in {CORE!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- one way through the code

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("kvtier.store",)
"""Packages held to the two rules below: no import circle runs through one of their modules,
and none of their modules reaches another module's private names. The rest of kvtier joins
as its own circles and private reaches go (issue 16)."""
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
"""Public despite the underscore (the namedtuple API)."""


def modules_of(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``) by dotted name."""
    out: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _lazy_exports(tree: ast.Module) -> set[ast.AST]:
    """Nodes of a module-level ``__getattr__`` (PEP 562): lazy re-exports, not imports of
    the module itself."""
    return {node for top in tree.body
            if isinstance(top, ast.FunctionDef) and top.name == "__getattr__"
            for node in ast.walk(top)}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports: at module level, under TYPE_CHECKING or
    inside a function alike (a circle hidden in a function is still a circle)."""
    tree = ast.parse(path.read_text(), str(path))
    lazy = _lazy_exports(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if node in lazy:
            continue
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    out.add(target)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or through others."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo += graph.get(node, ())
        reach[start] = seen
    groups = {frozenset(m for m in reach[node] if node in reach[m]) for node in graph
              if node in reach[node]}
    return sorted(sorted(group) for group in groups)


def private_reaches(path: Path) -> list[str]:
    """Where a module uses another's private names: ``from m import _x``, ``import m._x``,
    or ``obj._x`` on anything but ``self``/``cls`` (dunder names are not private)."""
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            dotted = (node.module or "").split(".")
            out += [f"{path.name}:{node.lineno}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if private(alias.name) or any(private(p) for p in dotted)]
        elif isinstance(node, ast.Import):
            out += [f"{path.name}:{node.lineno}: import {alias.name}" for alias in node.names
                    if any(private(p) for p in alias.name.split("."))]
        elif (isinstance(node, ast.Attribute) and private(node.attr)
              and node.attr not in NAMEDTUPLE_API
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def checked(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in CHECKED)


def test_no_import_circle_runs_through_the_store() -> None:
    modules = modules_of(ROOT, "kvtier")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = [group for group in circles(graph) if any(checked(m) for m in group)]
    assert found == [], f"modules that import each other: {found}"


def test_no_store_module_reaches_anothers_private_names() -> None:
    found = [reach for name, path in modules_of(ROOT, "kvtier").items() if checked(name)
             for reach in private_reaches(path)]
    assert found == [], "private names of other modules used:\n" + "\n".join(found)


def test_the_layering_checks_catch_what_they_forbid(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "def __getattr__(name):\n    from pkg.a import A\n    return A\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "def f():\n    from pkg import a\n    return a._hidden, a.__name__\n",
        "c.py": "from pkg.a import _x\nimport pkg._private\n"
                "class C:\n    def m(self):\n        return self._mine, self.x._theirs\n",
        "sub/__init__.py": "from . import d\n",
        "sub/d.py": "from .. import c\nt = (1, 2)\nt._replace\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules = modules_of(tmp_path, "pkg")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["pkg"] == set(), "a lazy re-export (PEP 562) is not an import"
    assert graph["pkg.sub"] == {"pkg.sub.d"} and graph["pkg.sub.d"] == {"pkg.c"}
    assert circles(graph) == [["pkg.a", "pkg.b"]], "TYPE_CHECKING and function imports count"
    assert private_reaches(pkg / "b.py") == ["b.py:3: a._hidden"]
    assert private_reaches(pkg / "c.py") == [
        "c.py:1: from pkg.a import _x", "c.py:2: import pkg._private",
        "c.py:5: self.x._theirs"]
    assert private_reaches(pkg / "sub" / "d.py") == []


def test_the_root_package_imports_its_public_names_on_first_use() -> None:
    script = (
        "import sys, kvtier\n"
        "from kvtier.version import __version__\n"
        "assert kvtier.__version__ == __version__\n"
        "heavy = ('kvtier.server', 'kvtier.store', 'kvtier.client')\n"
        "assert not [m for m in heavy if m in sys.modules], sorted(sys.modules)\n"
        "from kvtier import TieredStore\n"
        "assert TieredStore.__module__ == 'kvtier.store.core' and 'kvtier.store' in sys.modules\n"
        "try:\n"
        "    kvtier.NoSuchName\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'kvtier' has no attribute 'NoSuchName'"
