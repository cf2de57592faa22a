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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _foreign_names(tree: ast.Module, package: str) -> set[str]:
    """Names a module binds to imports from outside ``package`` (``import argparse``,
    ``from transformers.utils import chat_template_utils``): the private names reached through
    them (``argparse._SubParsersAction``) belong to the standard library or a third party,
    whose own business they are, not to another module of ``package``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                    if not _inside(alias.name, package)}
        elif (isinstance(node, ast.ImportFrom) and not node.level
              and not _inside(node.module or "", package)):
            out |= {alias.asname or alias.name for alias in node.names}
    return out


def _through_foreign(node: ast.Attribute, foreign: set[str]) -> bool:
    root = node.value
    while isinstance(root, ast.Attribute):
        root = root.value
    return isinstance(root, ast.Name) and root.id in foreign


def private_reaches(path: Path, package: str = "kvtier") -> list[str]:
    """Where a module uses the private names of another module of ``package``:
    ``from m import _x``, ``import m._x``, or ``obj._x`` on anything but ``self``/``cls``
    or a module imported from outside ``package`` (dunder names are not private)."""
    tree = ast.parse(path.read_text(), str(path))
    foreign = _foreign_names(tree, package)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if not (node.level or _inside(node.module or "", package)):
                continue
            dotted = (node.module or "").split(".")
            out += [f"{path.name}:{node.lineno}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if _private(alias.name) or any(_private(p) for p in dotted)]
        elif isinstance(node, ast.Import):
            out += [f"{path.name}:{node.lineno}: import {alias.name}" for alias in node.names
                    if _inside(alias.name, package)
                    and any(_private(p) for p in alias.name.split("."))]
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and node.attr not in NAMEDTUPLE_API
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
              and not _through_foreign(node, foreign)):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_import_circle_inside_kvtier() -> None:
    modules = modules_of(ROOT, "kvtier")
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = circles(graph)
    assert found == [], f"modules that import each other: {found}"


def test_no_kvtier_module_reaches_anothers_private_names() -> None:
    found = [f"{name}: {reach}" for name, path in modules_of(ROOT, "kvtier").items()
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
                "class C:\n    def m(self):\n        return self._mine, self.x._theirs\n"
                "import argparse, os.path\nfrom json import decoder as d\n"
                "argparse._SubParsersAction, os.path._j, d._x\n",
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
    assert private_reaches(pkg / "b.py", "pkg") == ["b.py:3: a._hidden"]
    assert private_reaches(pkg / "c.py", "pkg") == [
        "c.py:1: from pkg.a import _x", "c.py:2: import pkg._private",
        "c.py:5: self.x._theirs"], "private names of the standard library are not ours"
    assert private_reaches(pkg / "sub" / "d.py", "pkg") == []


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
    assert _python(script).strip() == "module 'kvtier' has no attribute 'NoSuchName'"


def test_the_placement_core_loads_without_the_store_runtime() -> None:
    """``kvtier trace simulate`` drives the pure placement core; importing it must not load
    the store's arena, threads or tiers."""
    script = (
        "import sys\n"
        "import kvtier.store.placement\n"
        "runtime = ('kvtier.store.core', 'kvtier.tiers.arena', 'kvtier.store.iopool')\n"
        "print([m for m in runtime if m in sys.modules])\n"
        "from kvtier.store import TieredStore\n"
        "print(TieredStore.__module__)\n"
    )
    assert _python(script).split("\n")[:2] == ["[]", "kvtier.store.core"]


def _python(script: str) -> str:
    """What ``script`` prints, run in a fresh interpreter (nothing imported yet)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---------------------------------------------------------------------- the launcher's layer

LAYERS = {"kvtier.vllm": ("kvtier.launch", "kvtier.bench"), "kvtier.launch": ("kvtier.bench",)}
"""Dependencies point one way: benchmarks → launcher → connector. The connector (kvtier.vllm)
knows neither the launcher nor the benchmarks; the launcher (``kvtier serve``) never reaches
into the benchmarks (peers are installed by them, not by ``kvtier serve``)."""


def _absolute_imports(module: str, path: Path) -> set[str]:
    """Every dotted name a module imports, anywhere in it (module level, TYPE_CHECKING,
    function bodies): ``from a.b import c`` gives ``a.b`` and ``a.b.c``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return out


def _reaches(imported: set[str], package: str) -> bool:
    return any(name == package or name.startswith(package + ".") for name in imported)


def test_the_connector_and_the_launcher_import_only_downward() -> None:
    seen: dict[str, set[str]] = {}
    for layer, forbidden in LAYERS.items():
        for path in sorted((ROOT / Path(*layer.split("."))).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            seen[name] = _absolute_imports(name, path)
            bad = sorted(p for p in forbidden if _reaches(seen[name], p))
            assert not bad, f"{name} imports {bad}; allowed: nothing of {list(forbidden)}"
    assert _reaches(seen["kvtier.launch.serve"], "kvtier.vllm"), "the scan sees imports"
    assert "kvtier.launch.vllm_router" in seen


# -------------------------------------------------------------- test-only code stays in tests/


def _test_module_names(tests: Path) -> set[str]:
    """The top-level names under which test code can be imported: ``tests`` itself, each
    module of a folder that is no package (pytest puts those folders on sys.path), and each
    package whose parent is no package."""
    names = {tests.name}
    for folder in [tests, *(p for p in tests.rglob("*") if p.is_dir())]:
        if "__pycache__" in folder.parts:
            continue
        if (folder / "__init__.py").exists():
            if not (folder.parent / "__init__.py").exists():
                names.add(folder.name)
        else:
            names |= {path.stem for path in folder.glob("*.py")}
    return names


def test_the_product_never_imports_test_code() -> None:
    """Test services and helpers live in tests/ (hangprobe and baselines measure the test
    services, reachable only from tests); no kvtier module imports anything from there."""
    test_names = _test_module_names(ROOT / "tests")
    assert {"service_fixtures", "services", "tests"} <= test_names, "the scan sees tests/"
    for name, path in modules_of(ROOT, "kvtier").items():
        bad = sorted(i for i in _absolute_imports(name, path)
                     if i.split(".")[0] in test_names)
        assert not bad, f"{name} imports test code {bad}; tests/ is never imported by kvtier"
    for gone in ("hangprobe", "baselines"):
        assert not list((ROOT / "kvtier").rglob(f"{gone}.py")), f"{gone} is test code"
        assert (ROOT / "tests" / "services" / f"{gone}.py").exists()
