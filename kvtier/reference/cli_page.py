"""docs/reference/cli.md: every command and subcommand of ``kvtier`` with its options, read
from the argument parsers :func:`kvtier.cli.build_parser` builds.

argparse lists a parser's actions and a subcommand's help only in private attributes; they
are read with ``vars()`` here, and tests/test_reference.py fails if that ever stops working.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from kvtier.reference import Unavailable
from kvtier.reference.markdown import code, page, paragraphs, prose, table

INTRO = """\
Every `kvtier` command and its options, generated from the argument parsers. Each option's
default is shown where it has one; an option marked *required* must be given.
"""


def render() -> str:
    from kvtier.cli import build_parser

    return page("Command line", INTRO, list(_sections(build_parser(), ["kvtier"])))


def _sections(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[str]:
    actions = vars(parser)["_actions"]
    subs = [a for a in actions if isinstance(a, argparse._SubParsersAction)]
    rows = [_row(a) for a in actions
            if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction)]
    parts = [f"## {' '.join(path)}"]
    if parser.description:
        parts.append(paragraphs(parser.description))
    for sub in subs:
        helps = {c.dest: c.help for c in vars(sub)["_choices_actions"]}
        for name, text in helps.items():
            if (text or "").startswith("(unavailable:"):  # kvtier.cli's stand-in
                raise Unavailable(f"cannot document `{' '.join([*path, name])}` here: "
                                  f"{text}; install kvtier with all its extras")
        parts.append(table(["command", "what it does"],
                           [[code(" ".join([*path, name])), prose(helps.get(name))]
                            for name in sorted(sub.choices)]))
    if rows:
        parts.append(table(["option", "default", "description"], rows))
    yield "\n\n".join(parts)
    for sub in subs:
        for name in sorted(sub.choices):
            yield from _sections(sub.choices[name], [*path, name])


def _row(action: argparse.Action) -> list[str]:
    return [code(_invocation(action)), _default(action), _help(action)]


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    flags = ", ".join(sorted(action.option_strings, key=lambda f: (f.startswith("--"), f)))
    if action.nargs == 0:
        return flags
    metavar = action.metavar or action.dest.upper()
    shown = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    if action.nargs in ("*", "+"):
        shown += " ..."
    return f"{flags} {shown}"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "*required*"
    value: Any = action.default
    if value is None or value == argparse.SUPPRESS or action.nargs == 0 or value == []:
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(map(str, value))
    return code(value)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if text == argparse.SUPPRESS:
        return ""
    if "%" in text:  # argparse's own expansion: %(default)s, %(choices)s, %%
        fields = {**vars(action), "prog": ""}
        if fields.get("choices") is not None:
            fields["choices"] = ", ".join(map(str, action.choices or ()))
        with contextlib.suppress(KeyError, ValueError, TypeError):  # else: as written
            text = text % fields
    out = prose(text)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        allowed = ", ".join(code(c) for c in action.choices)
        out = f"{out} (one of {allowed})" if out else f"one of {allowed}"
    return out
