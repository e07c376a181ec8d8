"""The ``hf-flatbias`` command line. Each sub-command lives in its own module of ``hf_flatbias.commands``.

Building the parser imports neither torch nor transformers (seconds on a busy machine): a command imports what it
needs inside its ``run`` function.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .commands import card, compare, demo, glue, select, trace

# Listed, not discovered: the order of `hf-flatbias --help` is chosen here, and a stray module in commands/ is not
# silently turned into a command.
COMMANDS = (trace, card, compare, select, glue, demo)

USAGE_ERROR = 2  # argparse's exit status for bad arguments; bad files and values are bad input too


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-flatbias", description="Flatness tools for Hugging Face models.")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="Show the full traceback of an error that is otherwise reported in one line.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code.

    Bad input (a `ValueError` or `OSError`: a missing file, a value out of range, a card that does not parse, a Hub
    error) is reported as one ``hf-flatbias COMMAND: error: ...`` line with exit code 2. Any other exception is a bug
    and keeps its traceback.
    """
    try:
        try:
            return _dispatch(build_parser().parse_args(argv))
        finally:
            # A reader that has gone (`hf-flatbias card X --json | head -1`) shows here, not at interpreter exit.
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: the rest of the output has nowhere to go; point stdout at devnull so that the
        # flush at exit does not raise again, and exit with 1 as Python does on a broken pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        raise  # an OSError, but not bad input
    except (ValueError, OSError) as error:
        if args.debug:
            raise
        print(f"hf-flatbias {args.command}: error: {error}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
