"""``kvtier bench compare BASELINE.json CANDIDATE.json --rule ...``: the rollout gate.

Prints every metric both runs have, side by side with candidate / baseline, then each rule's
verdict; exits 1 when a rule is broken (naming it), 2 when a rule or a file is unusable, 0
otherwise. Metrics are the ``metrics`` object of a ``bench multiround`` result, or the
top-level numbers of any other figures file (``bench ttft``, ``bench micro``); ``NaN`` and
``Infinity`` (which JSON readers accept) count as missing. Rules are parsed by
:mod:`kvtier.bench.rules`, never evaluated as Python.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.bench.rules import Verdict, parse_rule
from kvtier.errors import ConfigError
from kvtier.tables import table

Metrics = dict[str, float | None]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="baseline vs candidate results, side by side; exit 1 "
                       "when a rollout rule is broken")
    p.add_argument("baseline", help="results JSON of the baseline run")
    p.add_argument("candidate", help="results JSON of the candidate run")
    p.add_argument("--rule", action="append", default=[], metavar="EXPR",
                   help='e.g. "p99_ttft <= 1.10 * baseline" (repeatable; all must hold)')
    p.add_argument("--metrics", help="comma list of metrics to show (default: all shared)")
    p.add_argument("--json", dest="json_path", help="write the comparison and verdicts here")
    p.set_defaults(func=run)


def load_metrics(path: str) -> Metrics:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read results {path}: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a JSON object of results")
    inner = doc.get("metrics")
    source: dict[str, Any] = inner if isinstance(inner, dict) else doc
    metrics: Metrics = {}
    for name, value in source.items():
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            # json.loads reads NaN and Infinity: such a value is missing, never compared
            number = None if value is None else float(value)
            metrics[str(name)] = number if number is not None and math.isfinite(number) \
                else None
    if not any(v is not None for v in metrics.values()):
        raise ConfigError(f"{path}: no numeric metrics found")
    return metrics


def ratio(base: float | None, cand: float | None) -> float | None:
    if base is None or cand is None or base == 0:
        return None
    return cand / base


def compare(baseline: Metrics, candidate: Metrics, rules: Sequence[str],
            names: Sequence[str] | None = None) -> dict[str, Any]:
    known = set(baseline) | set(candidate)
    parsed = [parse_rule(r, known) for r in rules]  # all parsed before any is judged
    shown = list(names) if names else sorted(set(baseline) & set(candidate))
    unknown = [n for n in shown if n not in known]
    if unknown:
        raise ConfigError(f"--metrics: unknown metric {unknown[0]!r}")
    verdicts = [rule.evaluate(baseline, candidate) for rule in parsed]
    return {
        "metrics": {n: {"baseline": baseline.get(n), "candidate": candidate.get(n),
                        "ratio": ratio(baseline.get(n), candidate.get(n))} for n in shown},
        "rules": [{"rule": v.rule, "ok": v.ok, "steps": list(v.steps)} for v in verdicts],
        "ok": all(v.ok for v in verdicts),
    }


def run(args: argparse.Namespace) -> int:
    baseline, candidate = load_metrics(args.baseline), load_metrics(args.candidate)
    names = [n.strip() for n in args.metrics.split(",")] if args.metrics else None
    result = compare(baseline, candidate, args.rule, names)
    print_comparison(result["metrics"], args.baseline, args.candidate)
    verdicts = [Verdict(r["rule"], r["ok"], tuple(r["steps"])) for r in result["rules"]]
    for v in verdicts:
        print(f"{'ok    ' if v.ok else 'BROKEN'}  {v.rule}   [{'; '.join(v.steps)}]")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    broken = [v.rule for v in verdicts if not v.ok]
    if broken:
        print(f"kvtier bench compare: {len(broken)} rule(s) broken: "
              + "; ".join(repr(b) for b in broken), file=sys.stderr)
        return 1
    return 0


def print_comparison(rows: Mapping[str, Mapping[str, float | None]], base: str, cand: str
                     ) -> None:
    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else f"{value:{spec}}"

    print(f"baseline:  {base}\ncandidate: {cand}")
    print(table(["metric", "baseline", "candidate", "ratio"],
                [[name, cell(row["baseline"], ".6g"), cell(row["candidate"], ".6g"),
                  cell(row["ratio"], ".3f")] for name, row in rows.items()]))
