"""``python -m kvtier.reference [--out docs/reference] [--check]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.reference import COMMAND, DEFAULT_OUT, Unavailable, generate, stale, write

UNAVAILABLE = 3
"""Exit status when a part of kvtier cannot be imported here (nothing written or checked)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.reference",
                                     description="Write the reference pages generated from "
                                     "the code (cli.md, config.md, metrics.md).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="folder of the pages (default: %(default)s)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a page differs from the code")
    args = parser.parse_args(argv)
    try:
        pages = generate()
    except Unavailable as exc:
        print(f"python -m kvtier.reference: {exc}", file=sys.stderr)
        return UNAVAILABLE
    if args.check:
        differ = stale(args.out, pages)
        for name in differ:
            print(f"{args.out / name}: differs from the code; regenerate with: {COMMAND}",
                  file=sys.stderr)
        return 1 if differ else 0
    for name in write(args.out, pages):
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
