"""The one argparse parser of the command line and the recipes, and the forms of a flag's value.

A bad flag is one line: ``hf-flatbias`` and ``recipes/ruler_gate.py`` print it and exit with 2, the dataclass
recipes (`hf_flatbias.recipe_args`) raise it as a `ValueError` for `hf_flatbias.cli.run_recipe` to print; never
argparse's usage text first (35 lines for ``trace``, a screen of flags for the training arguments), which buries the
line that says what is wrong. A value of the wrong form names the flag and the form expected
(``argument --n-draws: expected a whole number (got 'abc')``), not the type function's name.

Kept free of the package's other modules (and of torch): `hf_flatbias.cli`, the commands and `measure_settings` all
import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

USAGE_ERROR = 2  # argparse's exit status for bad arguments; bad files and values are bad input too


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's errors (a missing argument, a flag of the wrong form) in one line.

    By default the line is printed as ``PROG: error: MESSAGE (PROG --help lists the flags)`` and the process exits
    with 2, as `hf_flatbias.cli.run_reporting_errors` reports a bad value; the sub-commands' parsers are of this
    class too. With ``raise_errors=True`` it is a `ValueError` of ``MESSAGE (--help lists the flags)`` instead, which
    the caller reports (a recipe's ``main`` under `hf_flatbias.cli.run_recipe`). Mixes into an ``ArgumentParser``
    subclass such as transformers' ``HfArgumentParser`` when listed first.
    """

    def __init__(self, *args: Any, raise_errors: bool = False, **kwargs: Any) -> None:
        self.raise_errors = raise_errors
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if self.raise_errors:
            raise ValueError(f"{message} (--help lists the flags)")
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


# A flag's type raises ArgumentTypeError: argparse shows its message after the flag's name, where a ValueError would
# show the function's own name instead ("invalid int value", "invalid _floats value").


def parsed_as(text: str, parse: Callable[[str], Any], form: str) -> Any:
    """``parse(text)``, or `argparse.ArgumentTypeError` saying ``expected FORM (got 'TEXT')``."""
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {form} (got {text!r})") from None


def whole_number(text: str) -> int:
    """The ``type`` of a whole-number flag (``--n-draws 4``)."""
    return parsed_as(text, int, "a whole number")


def number(text: str) -> float:
    """The ``type`` of a number flag (``--sam-rho 0.05``)."""
    return parsed_as(text, float, "a number")
