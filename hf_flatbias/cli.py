"""The ``hf-flatbias`` command line. Each sub-command lives in its own module of ``hf_flatbias.commands``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Sequence

from . import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-flatbias", description="Flatness tools for Hugging Face models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{module_info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Each ``register`` sets ``func`` on its parser; ``func(args)`` returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
