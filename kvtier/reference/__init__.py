"""The reference pages generated from the code, so they cannot drift from it.

``python -m kvtier.reference`` writes docs/reference/cli.md (every command's options, from the
argument parsers), config.md (every config key with type, default and bounds, from the config
structs) and metrics.md (every metric with type, labels and help, from the registries);
``--check`` compares instead of writing. Output is deterministic: sorted, no dates, no paths
of this machine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvtier.errors import KvtierError

PAGES: dict[str, str] = {
    "cli.md": "kvtier.reference.cli_page",
    "config.md": "kvtier.reference.config_page",
    "metrics.md": "kvtier.reference.metrics_page",
}
DEFAULT_OUT = Path("docs/reference")
COMMAND = "python -m kvtier.reference"
"""What regenerates the committed pages (from the repository's root)."""


class Unavailable(KvtierError):
    """A part of kvtier cannot be imported here (an optional dependency is missing), so its
    reference cannot be generated: nothing is written rather than a page with a hole."""


def generate() -> dict[str, str]:
    """``file name -> Markdown`` of every page."""
    import importlib

    renders: dict[str, Callable[[], str]] = {
        name: importlib.import_module(module).render for name, module in PAGES.items()}
    return {name: render() for name, render in renders.items()}


def stale(out: Path, pages: dict[str, str]) -> list[str]:
    """The pages whose file in ``out`` is missing or differs from ``pages``."""
    return [name for name, text in sorted(pages.items())
            if not (out / name).is_file() or (out / name).read_text() != text]


def write(out: Path, pages: dict[str, str]) -> list[str]:
    """Write the pages that changed; returns their names."""
    changed = stale(out, pages)
    out.mkdir(parents=True, exist_ok=True)
    for name in changed:
        tmp = out / f".{name}.tmp"
        tmp.write_text(pages[name])
        tmp.replace(out / name)
    return changed
