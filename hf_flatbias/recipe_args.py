"""Command-line parsing of the dataclass recipes (``recipes/bert_bookcorpus.py``, ``glue_compare.py``,
``sft_sam.py``): ``HfArgumentParser``, a YAML ``--config``, ``--smoke``.

It lives in the package, not beside the research code in ``recipes/research``: these recipes train and compare
ordinary Hugging Face models and share nothing with the synthetic-language research code (trl keeps its
``TrlParser`` beside its scripts for the same reason).

Precedence, lowest first: the dataclass defaults, the YAML file, the recipe's smoke settings (with ``--smoke``),
the command line. YAML values become command-line strings before parsing, so they are typed and validated exactly
like flags and an unknown key is an error rather than silently ignored. With ``--smoke`` the YAML's ``output_dir``
becomes ``<output_dir>-smoke`` (unless the command line names one), so a smoke run never leaves checkpoints where
the real run would resume from them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser


def _as_flags(values: Mapping[str, Any]) -> list[str]:
    flags: list[str] = []
    for key, value in values.items():
        if value is None:
            continue
        flags.append(f"--{key}")
        if isinstance(value, (list, tuple)):
            flags.extend(str(item) for item in value)
        elif isinstance(value, bool):
            flags.append(str(value).lower())
        else:
            flags.append(str(value))
    return flags


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping stored in a recipe's YAML config; a clear error for a missing file or a non-mapping."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such file (the recipes' configs are in recipes/configs/).")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path} must hold a mapping of argument names to values.")
    return values


def parse_dataclass_args(
    dataclass_types: Sequence[type],
    argv: Sequence[str] | None,
    *,
    smoke_settings: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> tuple[Any, ...]:
    """Parse ``argv`` into ``dataclass_types`` with a YAML ``--config`` and a ``--smoke`` preset.

    ``--smoke`` must also be a field of one of the dataclasses so the recipe sees it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    flags: list[str] = []
    values = load_yaml_config(known.config) if known.config else {}
    flags += _as_flags(values)
    smoke_requested = any(arg == "--smoke" or arg.startswith("--smoke=") for arg in rest) and not any(
        arg in ("--smoke=false", "--smoke=False") for arg in rest
    )
    if smoke_requested and smoke_settings:
        flags += _as_flags(smoke_settings)
    output_dir_given = any(arg == "--output_dir" or arg.startswith("--output_dir=") for arg in rest)
    if smoke_requested and values.get("output_dir") and not output_dir_given:
        # a smoke model left in the real run's folder would be "resumed" by the real run and fail on its shapes
        flags += ["--output_dir", f"{str(values['output_dir']).rstrip('/')}-smoke"]
    # No abbreviations: a misspelt YAML key such as learning_rat must fail, not quietly set learning_rate.
    parser = HfArgumentParser(tuple(dataclass_types), description=description, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of argument values (recipes/configs/*.yaml).")
    *parsed, namespace = parser.parse_args_into_dataclasses(args=flags + rest, look_for_args_file=False)
    del namespace  # only --config, already applied
    return tuple(parsed)
