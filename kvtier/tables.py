"""Plain text tables for the command line, drawn by rich.

Every table kvtier prints goes through :func:`table`, so they share one look: no borders,
two spaces between columns, no colour and no wrapping. The text is the same on a terminal,
in a pipe and in a test, so scripts and tests can read it. Cells are literal text: rich
markup (``[bold]``) and emoji codes in a cell, for instance in a name a client chose, are
printed as written, never interpreted.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console, JustifyMethod
from rich.table import Table
from rich.text import Text

_JUSTIFY: dict[str, JustifyMethod] = {"l": "left", "r": "right", "c": "center"}
# Wide enough that no real table wraps; a cell is never folded onto a second line.
_NO_WRAP_WIDTH = 100_000


def table(headers: Sequence[str] | None, rows: Sequence[Sequence[str]], *,
          align: str | None = None, indent: str = "", width: int | None = None) -> str:
    """``rows`` under ``headers`` (``None``: no header line) as aligned text.

    ``align`` has one letter per column, ``l``, ``r`` or ``c``; by default the first column
    is left-aligned and the others right (names, then figures). ``indent`` starts every
    line. ``width`` fits the table into that many characters by wrapping cells; by default
    columns take their widest cell. Trailing spaces are dropped.
    """
    columns = len(headers) if headers is not None else max((len(r) for r in rows), default=0)
    align = align if align is not None else "l" + "r" * max(0, columns - 1)
    if len(align) != columns or set(align) - set(_JUSTIFY):
        raise ValueError(f"align {align!r} needs one of l, r, c for each of {columns} columns")
    grid = Table(box=None, show_header=headers is not None, pad_edge=False, padding=(0, 1),
                 header_style="", show_edge=False)
    for i, how in enumerate(align):
        grid.add_column(Text(headers[i] if headers is not None else ""),
                        justify=_JUSTIFY[how], no_wrap=width is None)
    for row in rows:
        if len(row) != columns:
            raise ValueError(f"a row has {len(row)} cells, the table {columns} columns: {row!r}")
        grid.add_row(*(Text(cell) for cell in row))
    return render(grid, indent, width)


def render(grid: Table, indent: str = "", width: int | None = None) -> str:
    """A rich renderable as plain text: no colour, no terminal codes, no trailing spaces."""
    out = io.StringIO()
    console = Console(file=out, width=(width or _NO_WRAP_WIDTH) - len(indent),
                      color_system=None, force_terminal=False, no_color=True, highlight=False,
                      emoji=False, markup=False, legacy_windows=False)
    console.print(grid)
    return "\n".join((indent + line).rstrip() for line in out.getvalue().splitlines())
