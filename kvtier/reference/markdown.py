"""Markdown pieces of the generated reference: escaped table cells, code spans, tables."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from kvtier.config import runtime_dir

_SPECIAL = re.compile(r"([|*\\])")
_CODE = re.compile(r"(``?[^`]+``?)")
_MACHINE = tuple((real, shown) for real, shown in (
    (runtime_dir(), "$XDG_RUNTIME_DIR"), (str(Path.home()), "~"), (os.getcwd(), "."))
    if len(real) > 1)
"""Machine-specific text in defaults (a home folder) and the placeholder shown instead, so
the pages come out the same on every machine."""


_MACHINE_FIGURES = re.compile(r"(?<=default: )\d+ ?(?:KiB|MiB|GiB|TiB), (?=1/\d+ of )")
"""A default sized from this machine in a help text ("default: 3013MiB, 1/8 of this
machine's RAM"): the rule stays, the figure goes."""
_ROLE = re.compile(r":(?:mod|class|meth|func|data|attr|exc):(?=`)")
"""Sphinx roles in docstrings (``:mod:`kvtier.x```): the code span stays."""


def scrub(text: str) -> str:
    for real, shown in _MACHINE:
        text = text.replace(real, shown)
    return _ROLE.sub("", _MACHINE_FIGURES.sub("", text))


def prose(text: str | None) -> str:
    """Free text (a help string, a docstring) made safe for one table cell: one line,
    ``|`` and ``*`` escaped, ``<``/``>``/``&`` as entities, code spans kept."""
    if not text:
        return ""
    text = scrub(" ".join(text.split()))
    parts = _CODE.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:  # a code span: `x` or ``x`` (reST), shown as `x`
            inner = part.strip("`")
            out.append(code(inner))
        else:
            part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            out.append(_SPECIAL.sub(r"\\\1", part))
    return "".join(out)


def paragraphs(text: str | None) -> str:
    """Free text outside a table: its paragraphs kept, each made safe as :func:`prose`."""
    chunks = re.split(r"\n\s*\n", text or "")
    return "\n\n".join(prose(c) for c in chunks if c.strip())


def code(value: object) -> str:
    """``value`` as a code span (a ``|`` inside one still needs its escape in a table)."""
    text = scrub(str(value)).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}" if text else ""


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell or "" for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def page(title: str, intro: str, sections: Sequence[str]) -> str:
    """One page: a single H1, an intro, the sections; one blank line between blocks and a
    newline at the end."""
    body = "\n\n".join([f"# {title}", intro.strip(), *(s.strip() for s in sections)])
    return body + "\n"
