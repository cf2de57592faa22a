"""``kvtier serve``'s options as the CLI parses them, for tests that build a stack's options
without starting it."""

from __future__ import annotations

import argparse

from kvtier.launch.stack_options import StackOptions

GiB = 1 << 30


def parse(*argv: str) -> argparse.Namespace:
    from kvtier.launch.serve import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def options(*argv: str) -> StackOptions:
    return StackOptions.from_args(parse("--instances", "2", "--router", "none", *argv), 4 * GiB)
