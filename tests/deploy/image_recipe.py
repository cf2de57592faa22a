"""Reading the image recipes as a builder would, without one: Containerfile instructions,
the Makefile's install steps, and which files a ``.dockerignore`` lets into the build context.

The ignore rules follow Docker's (moby/patternmatcher, which Podman and Buildah share): each
line is a pattern relative to the context root, ``**`` spans folders, ``!`` re-includes, the
last matching line decides, and a pattern that matches a folder matches everything in it.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper case: FROM, RUN, COPY, ENTRYPOINT, ..."""
    value: str
    """The rest of the line, continuations joined."""

    def exec_form(self) -> list[str]:
        """``["a", "b"]`` as a list; ValueError for the shell form."""
        parsed = json.loads(self.value)
        if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
            raise ValueError(f"{self.keyword} {self.value!r} is not a JSON list of strings")
        return parsed


def instructions(path: Path) -> list[Instruction]:
    """The instructions of a Containerfile: comments dropped, ``\\`` continuations joined."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, value = text.partition(" ")
        out.append(Instruction(keyword.upper(), value.strip()))
    if pending:
        raise ValueError(f"{path}: the last instruction ends in a continuation")
    return out


def only(found: list[Instruction], keyword: str) -> Instruction:
    matches = [i for i in found if i.keyword == keyword]
    if len(matches) != 1:
        raise AssertionError(f"expected one {keyword}, found {len(matches)}")
    return matches[0]


def shell_commands(found: list[Instruction]) -> list[list[str]]:
    """Every command of every RUN, split at ``&&`` and ``;``, each as its words."""
    commands: list[list[str]] = []
    for ins in found:
        if ins.keyword != "RUN":
            continue
        words = shlex.split(ins.value)
        current: list[str] = []
        for word in words:
            if word in ("&&", ";", "||"):
                commands.append(current)
                current = []
            else:
                current.append(word)
        commands.append(current)
    return [c for c in commands if c]


@dataclass(frozen=True)
class PipSteps:
    extras: frozenset[str]
    """The extras of the one ``pip install`` of the project (``.[a,b]``)."""
    other_requirements: tuple[str, ...]
    """Anything else ``pip install`` was given (a package, a pin): should be empty."""
    uninstalled: frozenset[str]


_EXTRAS = re.compile(r"^(?:-e\s+)?'?\.\[([a-z0-9_,\s-]+)\]'?$")


def pip_steps(commands: list[list[str]]) -> PipSteps:
    """What the ``pip install`` / ``pip uninstall`` commands among ``commands`` do."""
    extras: set[str] | None = None
    others: list[str] = []
    uninstalled: set[str] = set()
    for words in commands:
        action, args = _pip_action(words)
        if action == "install":
            if args == ["pip"] and ("--upgrade" in words or "-U" in words):
                continue  # the installer itself, not what it installs
            for arg in args:
                m = _EXTRAS.match(arg)
                if m and extras is None:
                    extras = {e.strip() for e in m.group(1).split(",")}
                else:
                    others.append(arg)
        elif action == "uninstall":
            uninstalled.update(args)
    if extras is None:
        raise AssertionError("no `pip install .[extras]` of the project")
    return PipSteps(frozenset(extras), tuple(others), frozenset(uninstalled))


def _pip_action(words: list[str]) -> tuple[str | None, list[str]]:
    """(``install`` / ``uninstall`` / None, positional arguments) of one command."""
    if not words:
        return None, []
    head = Path(words[0]).name
    if head in ("python", "python3") and words[1:3] == ["-m", "pip"]:
        rest = words[3:]
    elif head == "pip" or head.endswith("/pip") or words[0] == "$(PIP)":
        rest = words[1:]
    else:
        return None, []
    if not rest or rest[0] not in ("install", "uninstall"):
        return None, []
    positional = [w for w in rest[1:] if not w.startswith("-")]
    if "-e" in rest:  # the editable target is the word after -e
        positional = [w for w in rest[1:] if not w.startswith("-") or w == "-e"]
        positional = [w for w in positional if w != "-e"]
    return rest[0], positional


def makefile_commands(path: Path, target: str) -> list[list[str]]:
    """The recipe lines of ``target`` in a Makefile, as words (``|| true`` tails split off)."""
    lines = path.read_text().splitlines()
    out: list[list[str]] = []
    inside = False
    for line in lines:
        if re.match(rf"^{re.escape(target)}\s*:", line):
            inside = True
            continue
        if inside:
            if not line.startswith("\t"):
                break
            body = line.strip()
            if body.startswith("#"):
                continue
            words = shlex.split(body)
            current: list[str] = []
            for word in words:
                if word in ("&&", ";", "||"):
                    out.append(current)
                    current = []
                else:
                    current.append(word)
            out.append(current)
    return [c for c in out if c]


# ---------------------------------------------------------------------- build context

@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    include: bool


def ignore_rules(path: Path) -> list[_Rule]:
    rules: list[_Rule] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line[1:].strip() if include else line
        pattern = pattern.strip("/")
        rules.append(_Rule(re.compile(_translate(pattern)), include))
    return rules


def _translate(pattern: str) -> str:
    """A Docker ignore pattern as an anchored regular expression over ``/``-paths."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "^" + "".join(out) + "$"


def in_context(relpath: str, rules: list[_Rule]) -> bool:
    """Whether the file ``relpath`` reaches the build context (Docker's last-match-wins over
    the path and each of its parent folders)."""
    parts = relpath.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        if any(rule.pattern.match(c) for c in candidates):
            excluded = not rule.include
    return not excluded
