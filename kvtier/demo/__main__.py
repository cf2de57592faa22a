"""``python -m kvtier.demo [--path DIR]``: build the demo model (once) and print where it is.

What ``kvtier serve`` without ``--model`` does on first use, as a step of its own: a
Kubernetes initContainer builds it into a volume the serving container then reads.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvtier.demo",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--path", help="the model's directory (default: "
                        "$KVTIER_CACHE_DIR/demo-model, else ~/.cache/kvtier/demo-model)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvtier.demo.model import ensure_demo_model

    args = build_parser().parse_args(argv)
    print(ensure_demo_model(args.path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
