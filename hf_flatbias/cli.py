"""The ``hf-flatbias`` command line. Each sub-command lives in its own module of ``hf_flatbias.commands``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .commands import card, compare, demo, glue, select, trace

# Listed, not discovered: the order of `hf-flatbias --help` is chosen here, and a stray module in commands/ is not
# silently turned into a command.
COMMANDS = (trace, card, compare, select, glue, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-flatbias", description="Flatness tools for Hugging Face models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Each ``register`` sets ``func`` on its parser; ``func(args)`` returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
