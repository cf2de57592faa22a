"""Rollout rules: small expressions over named metrics, parsed by hand (never ``eval``).

::

    p99_ttft <= 1.10 * baseline                    # bare name: the candidate's value;
                                                   # bare baseline: the same metric, baseline's
    total_tok_s >= 0.95 * baseline and errors <= baseline.errors
    candidate.p99_itl - baseline.p99_itl < 0.02

Grammar (a tokenizer, then recursive descent; types checked while parsing)::

    rule    := or                                  (must be a truth value)
    or      := and ("or" and)*
    and     := not ("and" not)*
    not     := "not" not | compare
    compare := sum [("<" | "<=" | ">" | ">=" | "==" | "!=") sum]
    sum     := product (("+" | "-") product)*
    product := unary (("*" | "/") unary)*
    unary   := ("-" | "+") unary | atom
    atom    := NUMBER | METRIC | baseline | candidate
             | (baseline | candidate) "." METRIC | "(" or ")"

A bare ``baseline`` / ``candidate`` stands for the one metric its comparison names (it is an
error if that comparison names none or several). Only known metric names are accepted;
anything else — quotes, calls, attribute access other than ``baseline.NAME``, powers,
brackets — is refused with the column where it starts. Rules are at most 400 characters and
nest at most 20 deep; numbers must be finite with exponents of at most three digits, and an
evaluation that overflows or divides by zero is an error, not a verdict.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from kvtier.errors import ConfigError

MAX_CHARS = 400
MAX_DEPTH = 20
SIDES = ("baseline", "candidate")
KEYWORDS = frozenset({"and", "or", "not", *SIDES})
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|==|!=|<|>|\+|-|\*|/|\(|\)|\.)
""", re.VERBOSE)
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}


class RuleError(ConfigError):
    """A rule that cannot be parsed or evaluated; the message says where and why."""


@dataclass(frozen=True)
class Tok:
    kind: str  # number, name, op, end
    text: str
    col: int


def tokenize(rule: str) -> list[Tok]:
    if len(rule) > MAX_CHARS:
        raise RuleError(f"rule is {len(rule)} characters long; at most {MAX_CHARS}")
    out: list[Tok] = []
    pos = 0
    while pos < len(rule):
        m = _TOKEN.match(rule, pos)
        if m is None:
            raise RuleError(f"unexpected character {rule[pos]!r} at column {pos + 1} of "
                            f"{rule!r}")
        kind = m.lastgroup or ""
        text = m.group()
        if kind == "op" and text == "*" and rule.startswith("**", pos):
            raise RuleError(f"'**' at column {pos + 1}: powers are not supported")
        if kind == "number":
            _check_number(text, pos)
        if kind != "space":
            out.append(Tok(kind, text, pos + 1))
        pos = m.end()
    out.append(Tok("end", "", len(rule) + 1))
    return out


def _check_number(text: str, pos: int) -> None:
    exponent = re.search(r"[eE][+-]?(\d+)$", text)
    if exponent and len(exponent.group(1)) > 3:
        raise RuleError(f"number {text!r} at column {pos + 1}: exponent too large")
    if not math.isfinite(float(text)):
        raise RuleError(f"number {text!r} at column {pos + 1} is not finite")


# ------------------------------------------------------------------ syntax tree


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Metric:
    side: str
    name: str


@dataclass(frozen=True)
class Subject:
    """A bare ``baseline``/``candidate``: bound to its comparison's metric after parsing."""

    side: str


@dataclass(frozen=True)
class Arith:
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Neg:
    operand: Node


@dataclass(frozen=True)
class Compare:
    op: str
    left: Node
    right: Node
    text: str


@dataclass(frozen=True)
class Logic:
    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Not:
    operand: Node


Node = Num | Metric | Subject | Arith | Neg | Compare | Logic | Not
BOOL, NUM = "truth value", "number"


class _Parser:
    def __init__(self, rule: str, known: Collection[str]) -> None:
        self.rule = rule
        self.known = known
        self.toks = tokenize(rule)
        self.i = 0
        self.depth = 0

    # helpers
    def peek(self) -> Tok:
        return self.toks[self.i]

    def take(self) -> Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def accept(self, *texts: str) -> Tok | None:
        tok = self.peek()
        if tok.kind in ("op", "name") and tok.text in texts:
            return self.take()
        return None

    def fail(self, tok: Tok, why: str) -> RuleError:
        where = f"column {tok.col}" if tok.kind != "end" else "the end"
        return RuleError(f"{why} at {where} of {self.rule!r}")

    def enter(self, tok: Tok) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.fail(tok, f"nested more than {MAX_DEPTH} deep")

    # grammar
    def parse(self) -> Node:
        node, kind = self.logic_or()
        end = self.peek()
        if end.kind != "end":
            raise self.fail(end, f"unexpected {end.text!r}")
        if kind != BOOL:
            raise RuleError(f"rule {self.rule!r} is a number, not a condition; compare it, "
                            "as in p99_ttft <= 1.1 * baseline")
        return node

    def logic_or(self) -> tuple[Node, str]:
        return self._logic("or", self.logic_and)

    def logic_and(self) -> tuple[Node, str]:
        return self._logic("and", self.logic_not)

    def _logic(self, op: str, sub: Callable[[], tuple[Node, str]]) -> tuple[Node, str]:
        left, kind = sub()
        while (tok := self.accept(op)) is not None:
            right, rkind = sub()
            if kind != BOOL or rkind != BOOL:
                raise self.fail(tok, f"'{op}' joins conditions, not numbers")
            left = Logic(op, left, right)
        return left, kind

    def logic_not(self) -> tuple[Node, str]:
        tok = self.accept("not")
        if tok is None:
            return self.compare()
        self.enter(tok)
        operand, kind = self.logic_not()
        self.depth -= 1
        if kind != BOOL:
            raise self.fail(tok, "'not' needs a condition")
        return Not(operand), BOOL

    def compare(self) -> tuple[Node, str]:
        start = self.peek().col - 1
        left, kind = self.sum()
        tok = self.accept(*_COMPARE)
        if tok is None:
            return left, kind
        right, rkind = self.sum()
        if kind != NUM or rkind != NUM:
            raise self.fail(tok, f"'{tok.text}' compares numbers")
        if self.peek().text in _COMPARE:
            raise self.fail(self.peek(), "chained comparisons are not supported; join them "
                            "with 'and'")
        text = self.rule[start:self.peek().col - 1].strip()
        return _bind_subject(Compare(tok.text, left, right, text), self), BOOL

    def sum(self) -> tuple[Node, str]:
        return self._arith(("+", "-"), self.product)

    def product(self) -> tuple[Node, str]:
        return self._arith(("*", "/"), self.unary)

    def _arith(self, ops: tuple[str, ...], sub: Callable[[], tuple[Node, str]]
               ) -> tuple[Node, str]:
        left, kind = sub()
        while (tok := self.accept(*ops)) is not None:
            right, rkind = sub()
            if kind != NUM or rkind != NUM:
                raise self.fail(tok, f"'{tok.text}' needs numbers on both sides")
            left = Arith(tok.text, left, right)
        return left, kind

    def unary(self) -> tuple[Node, str]:
        tok = self.accept("-", "+")
        if tok is None:
            return self.atom()
        self.enter(tok)
        operand, kind = self.unary()
        self.depth -= 1
        if kind != NUM:
            raise self.fail(tok, f"'{tok.text}' needs a number")
        return (Neg(operand) if tok.text == "-" else operand), NUM

    def atom(self) -> tuple[Node, str]:
        tok = self.take()
        if tok.kind == "number":
            return Num(float(tok.text)), NUM
        if tok.kind == "op" and tok.text == "(":
            self.enter(tok)
            node, kind = self.logic_or()
            self.depth -= 1
            close = self.take()
            if close.text != ")":
                raise self.fail(close, "expected ')'")
            return node, kind
        if tok.kind == "name":
            return self.name(tok), NUM
        if tok.kind == "end":
            raise self.fail(tok, "the rule ends too early")
        raise self.fail(tok, f"unexpected {tok.text!r}")

    def name(self, tok: Tok) -> Node:
        dot = self.accept(".")
        if tok.text in SIDES:
            if dot is None:
                return Subject(tok.text)
            metric = self.take()
            if metric.kind != "name" or metric.text in KEYWORDS:
                raise self.fail(metric, f"expected a metric name after '{tok.text}.'")
            return Metric(tok.text, self.metric(metric))
        if dot is not None:
            raise self.fail(dot, "'.' is allowed only in baseline.NAME or candidate.NAME")
        if tok.text in KEYWORDS:
            raise self.fail(tok, f"unexpected {tok.text!r}")
        return Metric("candidate", self.metric(tok))

    def metric(self, tok: Tok) -> str:
        if tok.text not in self.known:
            close = difflib.get_close_matches(tok.text, list(self.known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise self.fail(tok, f"unknown metric {tok.text!r}{hint}")
        return tok.text


def _bind_subject(cmp: Compare, parser: _Parser) -> Compare:
    names = sorted(_bare_metrics(cmp))
    if not _has_subject(cmp):
        return cmp
    if len(names) != 1:
        raise RuleError(f"in {cmp.text!r}: a bare baseline/candidate stands for the one "
                        f"metric the comparison names, but it names {len(names) or 'none'}"
                        + (f" ({', '.join(names)})" if names else "")
                        + "; write baseline.NAME")
    return Compare(cmp.op, _bind(cmp.left, names[0]), _bind(cmp.right, names[0]), cmp.text)


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, Arith | Compare | Logic):
        return (node.left, node.right)
    if isinstance(node, Neg | Not):
        return (node.operand,)
    return ()


def _bare_metrics(node: Node) -> set[str]:
    out = {node.name} if isinstance(node, Metric) else set()
    for child in _children(node):
        out |= _bare_metrics(child)
    return out


def _has_subject(node: Node) -> bool:
    return isinstance(node, Subject) or any(_has_subject(c) for c in _children(node))


def _bind(node: Node, name: str) -> Node:
    if isinstance(node, Subject):
        return Metric(node.side, name)
    if isinstance(node, Arith):
        return Arith(node.op, _bind(node.left, name), _bind(node.right, name))
    if isinstance(node, Neg):
        return Neg(_bind(node.operand, name))
    return node


# ------------------------------------------------------------------ evaluation


@dataclass(frozen=True)
class Rule:
    text: str
    tree: Node

    def evaluate(self, baseline: Mapping[str, float | None],
                 candidate: Mapping[str, float | None]) -> Verdict:
        steps: list[str] = []
        ok = bool(_eval(self.tree, {"baseline": baseline, "candidate": candidate}, steps))
        return Verdict(self.text, ok, tuple(steps))


@dataclass(frozen=True)
class Verdict:
    rule: str
    ok: bool
    steps: tuple[str, ...]
    """Each comparison as evaluated: ``0.512 <= 0.495``."""


def parse_rule(rule: str, known: Collection[str]) -> Rule:
    return Rule(rule, _Parser(rule, known).parse())


def _eval(node: Node, sides: Mapping[str, Mapping[str, float | None]], steps: list[str]
          ) -> float | bool:
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Metric):
        value = sides[node.side].get(node.name)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):  # NaN passes `not x > y`: missing, refused
            raise RuleError(f"metric {node.name!r} has no value in the {node.side}"
                            + ("" if value is None else f" ({value!r} is not a number)"))
        return float(value)
    if isinstance(node, Neg):
        return -_num(node.operand, sides, steps)
    if isinstance(node, Arith):
        return _arith(node, _num(node.left, sides, steps), _num(node.right, sides, steps))
    if isinstance(node, Compare):
        a, b = _num(node.left, sides, steps), _num(node.right, sides, steps)
        result = _COMPARE[node.op](a, b)
        steps.append(f"{node.text}: {a:.6g} {node.op} {b:.6g}")
        return result
    if isinstance(node, Not):
        return not _eval(node.operand, sides, steps)
    if isinstance(node, Logic):
        left = bool(_eval(node.left, sides, steps))
        right = bool(_eval(node.right, sides, steps))  # both sides: every step is shown
        return (left and right) if node.op == "and" else (left or right)
    raise RuleError(f"unbound {node!r}")  # a Subject outside any comparison


def _num(node: Node, sides: Mapping[str, Mapping[str, float | None]], steps: list[str]
         ) -> float:
    value = _eval(node, sides, steps)
    assert not isinstance(value, bool)  # the parser checked the types
    return value


def _arith(node: Arith, a: float, b: float) -> float:
    if node.op == "/" and b == 0:
        raise RuleError("division by zero while evaluating the rule")
    if node.op == "+":
        result = a + b
    elif node.op == "-":
        result = a - b
    elif node.op == "*":
        result = a * b
    else:
        result = a / b
    if not math.isfinite(result):
        raise RuleError("a value overflowed while evaluating the rule")
    return result
