"""The ``hf-flatbias`` command line. Each sub-command lives in its own module of ``hf_flatbias.commands``.

Building the parser imports neither torch nor transformers (seconds on a busy machine): a command imports what it
needs inside its ``run`` function.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .argparsing import USAGE_ERROR, OneLineErrorParser
from .commands import card, compare, demo, glue, select, trace

# Listed, not discovered: the order of `hf-flatbias --help` is chosen here, and a stray module in commands/ is not
# silently turned into a command.
COMMANDS = (trace, card, compare, select, glue, demo)

INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="hf-flatbias", description="Flatness tools for Hugging Face models.")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="Show the full traceback of an error that is otherwise reported in one line.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    # `hf-flatbias trace ... --debug` as well as `hf-flatbias --debug trace ...`
    for subparser in subparsers.choices.values():
        subparser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code.

    Bad input is reported as one ``hf-flatbias COMMAND: error: ...`` line with exit code 2 (see
    `run_reporting_errors`); ``--debug`` shows the traceback.
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
    return run_reporting_errors(f"hf-flatbias {args.command}", lambda: args.func(args), debug=args.debug)


def run_reporting_errors(name: str, call: Callable[[], Any], *, debug: bool = False, note: str | None = None) -> int:
    """Run ``call`` and return its exit code, reporting a user's error in one line instead of a traceback.

    Bad input (a `ValueError` or `OSError`: a missing file, a value out of range, a card that does not parse, a Hub
    error) prints ``NAME: error: ...`` and returns 2; Ctrl-C prints ``NAME: interrupted`` and returns 130. Any other
    exception is a bug and keeps its traceback; with ``debug`` every exception does. The command line and the
    recipes' ``main`` (see `run_recipe`) report errors through this one function. ``note`` ends the error's line.
    """
    try:
        result = call()
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except BrokenPipeError:
        raise  # an OSError, but not bad input
    except (ValueError, OSError) as error:
        if debug:
            raise
        print(f"{name}: error: {one_line(str(error))}" + (f" ({note})" if note else ""), file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{name}: interrupted", file=sys.stderr)
        return INTERRUPTED


def one_line(message: str) -> str:
    """A message's lines joined into one: an error is reported in one line, whichever library wrote it."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def run_recipe(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
    """A recipe's ``if __name__ == "__main__":`` line: ``main(argv)`` with its user errors in one line.

    ``--debug`` anywhere on the command line is taken out of ``argv`` and shows the full traceback instead, as
    ``hf-flatbias --debug`` does.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    name = Path(sys.argv[0]).name
    raise SystemExit(run_reporting_errors(name, lambda: main(argv), debug=debug, note=accelerate_launch_note()))


def accelerate_launch_note() -> str | None:
    """What the traceback after a recipe's error line is, when ``accelerate launch`` without ``-q`` started it:
    its launcher raises ``CalledProcessError`` for any child that exits non-zero, which no child can prevent, so
    the recipe's one line says so. ``None`` otherwise (or when the launcher's command line cannot be read)."""
    if "ACCELERATE_MIXED_PRECISION" not in os.environ:  # set by every accelerate launcher for its children
        return None
    try:
        import psutil

        launcher = psutil.Process(os.getppid()).cmdline()
    except Exception:  # noqa: BLE001 - no psutil, a launcher gone or unreadable: no note, the error line stands
        return None
    if not any("accelerate" in part for part in launcher) or {"-q", "--quiet"} & set(launcher):
        return None
    return (
        "accelerate's launcher follows a failed run with a traceback of its own, which repeats this line; launch "
        "with accelerate launch -q to see this line alone"
    )


if __name__ == "__main__":
    raise SystemExit(main())
