"""Rollout rules: small expressions over named metrics, read by Python's own parser
(``ast.parse``) and walked here over a whitelist of node types — never ``eval``.

::

    p99_ttft <= 1.10 * baseline                    # bare name: the candidate's value;
                                                   # bare baseline: the same metric, baseline's
    total_tok_s >= 0.95 * baseline and errors <= baseline.errors
    candidate.p99_itl - baseline.p99_itl < 0.02

Allowed (:data:`ALLOWED`): numbers, metric names, ``baseline.NAME`` / ``candidate.NAME``,
``+ - * /``, one of ``< <= > >= == !=`` per comparison, ``and``, ``or``, ``not`` and
parentheses, with Python's precedence. A bare ``baseline`` / ``candidate`` stands for the one
metric its comparison names (it is an error if that comparison names none or several). Types
are checked before anything is evaluated: ``and``/``or``/``not`` join conditions, arithmetic
and comparisons take numbers, and the rule must be a condition.

Before Python sees it, a rule must be at most 400 ASCII characters of the kinds above (no
quotes, brackets, commas, colons...), with balanced parentheses nested at most 20 deep; after,
only the node types above pass, only known metric names (with a suggestion), numbers written
as digits with an exponent of at most three digits, and at most 20 nested signs or ``not``.
An evaluation that overflows or divides by zero is an error, not a verdict. Every refusal
names the column where the offending part starts.
"""

from __future__ import annotations

import ast
import difflib
import math
import operator
import re
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from kvtier.errors import ConfigError

MAX_CHARS = 400
MAX_DEPTH = 20
SIDES = ("baseline", "candidate")
ALLOWED = ("numbers, metric names, baseline.NAME, candidate.NAME, + - * /, "
           "< <= > >= == !=, and, or, not, parentheses")
_BAD_CHAR = re.compile(r"[^A-Za-z0-9_.+\-*/<>=!() \t\r\n]")
_LONE_EQUALS = re.compile(r"(?<![<>=!])=(?!=)")
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?(\d+))?")
_ARITH: dict[type[ast.operator], tuple[str, Callable[[float, float], float]]] = {
    ast.Add: ("+", operator.add), ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul), ast.Div: ("/", operator.truediv),
}
_COMPARE: dict[type[ast.cmpop], tuple[str, Callable[[float, float], bool]]] = {
    ast.Lt: ("<", operator.lt), ast.LtE: ("<=", operator.le), ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge), ast.Eq: ("==", operator.eq), ast.NotEq: ("!=", operator.ne),
}
BOOL, NUM = "truth value", "number"
Sides = Mapping[str, Mapping[str, float | None]]


class RuleError(ConfigError):
    """A rule that cannot be parsed or evaluated; the message says where and why."""


@dataclass(frozen=True)
class Verdict:
    rule: str
    ok: bool
    steps: tuple[str, ...]
    """Each comparison as evaluated: ``0.512 <= 0.495``."""


@dataclass(frozen=True)
class Rule:
    text: str
    tree: ast.expr
    """Checked by :func:`parse_rule`: only whitelisted nodes, types consistent."""

    def evaluate(self, baseline: Mapping[str, float | None],
                 candidate: Mapping[str, float | None]) -> Verdict:
        walk = _Evaluator(self.text, {"baseline": baseline, "candidate": candidate})
        ok = bool(walk.eval(self.tree))
        return Verdict(self.text, ok, tuple(walk.steps))


def parse_rule(rule: str, known: Collection[str]) -> Rule:
    """The rule, checked against the whitelist and ``known`` metric names; or RuleError."""
    _check_text(rule)
    if not rule.strip():
        raise RuleError("the rule is empty")
    try:
        with warnings.catch_warnings():  # "1and x" parses, with a warning on stderr
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(_source(rule), mode="eval").body
    except SyntaxError as exc:
        raise _syntax_error(rule, exc) from None
    if _Checker(rule, known).kind(tree, 0) != BOOL:
        raise RuleError(f"rule {rule!r} is a number, not a condition; compare it, "
                        "as in p99_ttft <= 1.1 * baseline")
    return Rule(rule, tree)


def _source(rule: str) -> str:
    """What Python parses: the rule on one line, in parentheses (so leading spaces are no
    indent). The parentheses are balanced (:func:`_check_text`), so they only group; and a
    node's 0-based ``col_offset`` in it is its 1-based column in the rule."""
    return "(" + re.sub(r"\s", " ", rule) + ")"


def _check_text(rule: str) -> None:
    """Length, characters and parentheses, before Python's parser sees the text."""
    if len(rule) > MAX_CHARS:
        raise RuleError(f"rule is {len(rule)} characters long; at most {MAX_CHARS}")
    bad = _BAD_CHAR.search(rule)
    if bad is not None:
        raise RuleError(f"unexpected character {bad.group()!r} at column {bad.start() + 1} of "
                        f"{rule!r}; a rule uses {ALLOWED}")
    equals = _LONE_EQUALS.search(rule)
    if equals is not None:
        raise RuleError(f"unexpected character '=' at column {equals.start() + 1} of {rule!r}; "
                        "compare with ==")
    depth = 0
    for col, char in enumerate(rule, 1):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise RuleError(f"unexpected ')' at column {col} of {rule!r}")
        if depth > MAX_DEPTH:
            raise RuleError(f"nested more than {MAX_DEPTH} deep at column {col} of {rule!r}")
    if depth:
        raise RuleError(f"expected ')' at the end of {rule!r}")


def _text(rule: str, node: ast.expr) -> str:
    """The part of the rule, as written, that ``node`` was parsed from (see :func:`_source`)."""
    return rule[node.col_offset - 1:(node.end_col_offset or 0) - 1]


def _syntax_error(rule: str, exc: SyntaxError) -> RuleError:
    col = max(1, (exc.offset or 0) - 1)
    if not exc.offset or col > len(rule.rstrip()):
        return RuleError(f"the rule ends too early: {rule!r}")
    return RuleError(f"cannot read {rule!r} at column {col} ({exc.msg}); a rule uses "
                     f"{ALLOWED}")


# ------------------------------------------------------------------ the whitelist


class _Checker:
    """Walks the tree once: every node allowed, every name known, types consistent."""

    def __init__(self, rule: str, known: Collection[str]) -> None:
        self.rule = rule
        self.known = known

    def fail(self, node: ast.expr, why: str) -> RuleError:
        return RuleError(f"{why} at column {node.col_offset} of {self.rule!r}")

    def not_allowed(self, node: ast.expr, what: str) -> RuleError:
        return RuleError(f"{what} at column {node.col_offset} of {self.rule!r} is not allowed; "
                         f"a rule uses {ALLOWED}")

    def kind(self, node: ast.expr, depth: int) -> str:
        """BOOL or NUM; RuleError for anything off the whitelist."""
        if isinstance(node, ast.Constant):
            self.number(node)
        elif isinstance(node, ast.Name):
            if node.id not in SIDES:
                self.metric(node, node.id)
        elif isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in SIDES):
                raise self.fail(node, "'.' is allowed only in baseline.NAME or candidate.NAME")
            self.metric(node, node.attr)
        elif isinstance(node, ast.UnaryOp):
            return self.unary(node, depth + 1)
        elif isinstance(node, ast.BinOp):
            self.arith(node, depth)
        elif isinstance(node, ast.BoolOp):
            word = "and" if isinstance(node.op, ast.And) else "or"
            if any(self.kind(v, depth) != BOOL for v in node.values):
                raise self.fail(node, f"'{word}' joins conditions, not numbers")
            return BOOL
        elif isinstance(node, ast.Compare):
            self.compare(node, depth)
            return BOOL
        else:
            raise self.not_allowed(node, _describe(node))
        return NUM

    def number(self, node: ast.Constant) -> None:
        text = _text(self.rule, node)
        match = _NUMBER.fullmatch(text)
        if type(node.value) not in (int, float) or match is None:
            raise self.fail(node, f"{text!r} is not a number written in digits (as 12, 0.5 or "
                            "1e-3)")
        if match.group(1) is not None and len(match.group(1)) > 3:
            raise self.fail(node, f"number {text!r}: exponent too large")
        if not math.isfinite(float(text)):
            raise self.fail(node, f"number {text!r} is not finite")

    def metric(self, node: ast.expr, name: str) -> None:
        if name not in self.known:
            close = difflib.get_close_matches(name, list(self.known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise self.fail(node, f"unknown metric {name!r}{hint}")

    def unary(self, node: ast.UnaryOp, depth: int) -> str:
        if depth > MAX_DEPTH:
            raise self.fail(node, f"nested more than {MAX_DEPTH} deep")
        if isinstance(node.op, ast.Not):
            if self.kind(node.operand, depth) != BOOL:
                raise self.fail(node, "'not' needs a condition")
            return BOOL
        sign = {ast.USub: "-", ast.UAdd: "+"}.get(type(node.op))
        if sign is None:
            raise self.not_allowed(node, _describe(node))
        if self.kind(node.operand, depth) != NUM:
            raise self.fail(node, f"'{sign}' needs a number")
        return NUM

    def arith(self, node: ast.BinOp, depth: int) -> None:
        if isinstance(node.op, ast.Pow):
            raise RuleError(f"'**' at column {node.col_offset} of {self.rule!r}: powers are not "
                            f"supported; a rule uses {ALLOWED}")
        if type(node.op) not in _ARITH:
            raise self.not_allowed(node, _describe(node.op))
        if self.kind(node.left, depth) != NUM or self.kind(node.right, depth) != NUM:
            raise self.fail(node, f"'{_ARITH[type(node.op)][0]}' needs numbers on both sides")

    def compare(self, node: ast.Compare, depth: int) -> None:
        if len(node.ops) > 1:
            raise self.fail(node, "chained comparisons are not supported; join them with "
                            "'and'")
        if type(node.ops[0]) not in _COMPARE:
            raise self.not_allowed(node, _describe(node.ops[0]))
        symbol = _COMPARE[type(node.ops[0])][0]
        if self.kind(node.left, depth) != NUM or self.kind(node.comparators[0], depth) != NUM:
            raise self.fail(node, f"'{symbol}' compares numbers")
        _subject(node, _text(self.rule, node))


def _describe(node: ast.AST) -> str:
    words = {ast.Call: "a call", ast.Is: "'is'", ast.IsNot: "'is not'", ast.In: "'in'",
             ast.NotIn: "'not in'", ast.IfExp: "'if'", ast.Tuple: "'()' with nothing inside",
             ast.FloorDiv: "'//'", ast.LShift: "'<<'", ast.RShift: "'>>'",
             ast.Await: "'await'", ast.Yield: "'yield'"}
    return words.get(type(node), f"a {type(node).__name__} expression")


# ------------------------------------------------------------------ bare baseline/candidate


def _subject(node: ast.Compare, text: str) -> str | None:
    """The metric a bare ``baseline``/``candidate`` in this comparison stands for, if any:
    the one metric it names, bare or as ``SIDE.NAME``."""
    nodes = list(ast.walk(node))
    sided = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    if not any(isinstance(n, ast.Name) and n.id in SIDES and id(n) not in sided
               for n in nodes):
        return None
    names = sorted({n.attr for n in nodes if isinstance(n, ast.Attribute)}
                   | {n.id for n in nodes if isinstance(n, ast.Name) and n.id not in SIDES})
    if len(names) != 1:
        raise RuleError(f"in {text!r}: a bare baseline/candidate stands for the one "
                        f"metric the comparison names, but it names {len(names) or 'none'}"
                        + (f" ({', '.join(names)})" if names else "")
                        + "; write baseline.NAME")
    return names[0]


# ------------------------------------------------------------------ evaluation


class _Evaluator:
    """Evaluates a checked tree; every comparison is recorded as evaluated."""

    def __init__(self, rule: str, sides: Sides) -> None:
        self.rule = rule
        self.sides = sides
        self.steps: list[str] = []

    def eval(self, node: ast.expr, subject: str | None = None) -> float | bool:
        if isinstance(node, ast.Constant):
            assert isinstance(node.value, int | float)  # the checker made sure
            return float(node.value)
        if isinstance(node, ast.Name):
            if node.id in SIDES:
                assert subject is not None  # the checker bound it
                return self.metric(node.id, subject)
            return self.metric("candidate", node.id)
        if isinstance(node, ast.Attribute):
            assert isinstance(node.value, ast.Name)
            return self.metric(node.value.id, node.attr)
        if isinstance(node, ast.UnaryOp):
            value = self.eval(node.operand, subject)
            if isinstance(node.op, ast.Not):
                return not value
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            return self.arith(node, subject)
        if isinstance(node, ast.BoolOp):
            values = [bool(self.eval(v)) for v in node.values]  # all: every step is shown
            return all(values) if isinstance(node.op, ast.And) else any(values)
        assert isinstance(node, ast.Compare)
        return self.compare(node)

    def metric(self, side: str, name: str) -> float:
        value = self.sides[side].get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):  # NaN passes `not x > y`: missing, refused
            raise RuleError(f"metric {name!r} has no value in the {side}"
                            + ("" if value is None else f" ({value!r} is not a number)"))
        return float(value)

    def arith(self, node: ast.BinOp, subject: str | None) -> float:
        a, b = self.eval(node.left, subject), self.eval(node.right, subject)
        if isinstance(node.op, ast.Div) and b == 0:
            raise RuleError("division by zero while evaluating the rule")
        result = _ARITH[type(node.op)][1](a, b)
        if not math.isfinite(result):
            raise RuleError("a value overflowed while evaluating the rule")
        return result

    def compare(self, node: ast.Compare) -> bool:
        text = _text(self.rule, node)
        subject = _subject(node, text)
        a, b = self.eval(node.left, subject), self.eval(node.comparators[0], subject)
        symbol, op = _COMPARE[type(node.ops[0])]
        result = op(a, b)
        self.steps.append(f"{text}: {a:.6g} {symbol} {b:.6g}")
        return result
