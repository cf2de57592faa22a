"""Attribute docstrings: the string literal written under a field of a class body.

Python keeps them nowhere at run time; they are read from the class's source, for each class
of its MRO, so a field documented where it is declared is documented everywhere it is used.
"""

from __future__ import annotations

import ast
import inspect
import textwrap


def field_docs(cls: type) -> dict[str, str]:
    """``field name -> docstring`` of ``cls`` and its bases (the nearest declaration wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "msgspec") or klass.__module__.startswith("msgspec"):
            continue
        out.update(_own_docs(klass))
    return out


def _own_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = next((node.body for node in ast.parse(source).body
                 if isinstance(node, ast.ClassDef)), [])
    out: dict[str, str] = {}
    for stmt, after in zip(body, [*body[1:], None], strict=True):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            out[stmt.target.id] = inspect.cleandoc(after.value.value)
    return out
