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

`check_before_loading` runs first in every recipe's ``main``: it reads the same merged values and refuses, in one
line, what can be refused without torch or transformers (a flatness value out of range, a reporter that is not
installed, an empty data file), so a bad flag costs a second, not the seconds of the heavy imports or the minutes of
data preparation that follow.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .argparsing import OneLineErrorParser


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


def _merged_flags(argv: Sequence[str], smoke_settings: Mapping[str, Any] | None) -> list[str]:
    """The flags a recipe parses, lowest precedence first: the YAML ``--config``, the smoke settings, ``argv``."""
    pre = OneLineErrorParser(add_help=False, allow_abbrev=False, raise_errors=True)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
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
    return flags + rest


def parse_dataclass_args(
    dataclass_types: Sequence[type],
    argv: Sequence[str] | None,
    *,
    smoke_settings: Mapping[str, Any] | None = None,
    description: str | None = None,
) -> tuple[Any, ...]:
    """Parse ``argv`` into ``dataclass_types`` with a YAML ``--config`` and a ``--smoke`` preset.

    ``--smoke`` must also be a field of one of the dataclasses so the recipe sees it. A flag the parser refuses (an
    unknown name, a value of the wrong type or outside its choices) is a `ValueError` of one line, not argparse's
    usage text of every training argument.
    """
    from transformers import HfArgumentParser

    class _Parser(OneLineErrorParser, HfArgumentParser):
        pass

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = _merged_flags(argv, smoke_settings)
    # No abbreviations: a misspelt YAML key such as learning_rat must fail, not quietly set learning_rate.
    parser = _Parser(tuple(dataclass_types), description=description, allow_abbrev=False, raise_errors=True)
    parser.add_argument("--config", default=None, help="YAML file of argument values (recipes/configs/*.yaml).")
    *parsed, namespace = parser.parse_args_into_dataclasses(args=flags, look_for_args_file=False)
    del namespace  # only --config, already applied
    return tuple(parsed)


# --------------------------------------------------------------------------- checks before the heavy imports


def merged_values(argv: Sequence[str], smoke_settings: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """Every flag's values after the YAML, the smoke settings and ``argv`` are merged, the last occurrence winning:
    ``{"sam_rho": ["-1"], "report_to": ["tensorboard"], "smoke": []}``. Nothing is typed or imported."""
    values: dict[str, list[str]] = {}
    name = None
    for arg in _merged_flags(argv, smoke_settings):
        if arg.startswith("--"):
            name, has_value, value = arg[2:].partition("=")
            values[name] = [value] if has_value else []
        elif name is not None:
            values[name].append(arg)
    return values


# The flatness fields a recipe's flags set, with FlatBiasConfig's rules (hf_flatbias/config.py; a test checks both
# refuse the same values): (type, lowest, lowest allowed, highest or None, the hint after the message).
FLATNESS_FIELD_RULES: dict[str, tuple[type, float, bool, float | None, str]] = {
    "sam_rho": (float, 0, False, None, "the SAM paper uses 0.05."),
    "asam_eta": (float, 0, True, None, "ASAM uses 0.01."),
    "sam_ascent_fraction": (float, 0, False, 1, "1 uses every row."),
    "looksam_alpha": (float, 0, True, None, "LookSAM uses 0.7."),
    "penalty_lambda": (float, 0, False, None, "the default is 0.01."),
    "penalty_fd_step": (float, 0, False, None, "the default is 0.01."),
    "sam_every_k": (int, 1, True, None, "1 runs SAM on every update."),
    "sam_start_step": (int, 0, True, None, "0 starts SAM at the first update."),
    "sam_end_step": (int, -1, True, None, "-1 keeps SAM to the end of training."),
    "sam_rho_warmup_steps": (int, 0, True, None, "0 for the constant schedule."),
}


def flatness_value_error(name: str, text: str) -> str | None:
    """Why the flag value ``text`` of flatness field ``name`` is refused, or None when it is fine."""
    kind, lowest, inclusive, highest, hint = FLATNESS_FIELD_RULES[name]
    what = "an integer" if kind is int else "a finite number"
    try:
        value = kind(text.strip())
    except ValueError:
        return f"--{name} must be {what}, got {text!r}; {hint}"
    below = value < lowest if inclusive else value <= lowest
    if (kind is float and not math.isfinite(value)) or below or (highest is not None and value > highest):
        bound = f"in ({lowest}, {highest}]" if highest is not None else f"{'>=' if inclusive else '>'} {lowest}"
        return f"{name} must be {what} {bound} (got {value!r}); {hint}"
    return None


# transformers' reporters and the modules whose presence it checks (transformers.integrations.integration_utils);
# a reporter not listed here is left to transformers.
REPORTER_MODULES = {
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "comet_ml": ("comet_ml",),
    "neptune": ("neptune",),
    "clearml": ("clearml",),
    "codecarbon": ("codecarbon",),
    "dvclive": ("dvclive",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
    "azure_ml": ("azureml",),
    "dagshub": ("dagshub",),
}
REPORTER_PACKAGES = {"comet_ml": "comet-ml", "azure_ml": "azureml-core"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_reporters(report_to: Sequence[str]) -> list[str]:
    """The reporters named in ``report_to`` whose package is not installed (``all`` and ``none`` need none)."""
    names = [name for item in report_to for name in item.replace(",", " ").split()]
    return [
        name
        for name in names
        if name in REPORTER_MODULES and not any(_installed(module) for module in REPORTER_MODULES[name])
    ]


def check_reporters(report_to: Sequence[str]) -> None:
    """Refuse, in one line, a ``report_to`` that names a reporter whose package is missing.

    transformers refuses it too, but only when the Trainer is built, after the data has been prepared, and as a
    traceback. A reporter the user named is not dropped silently: the run would end without the curves asked for.
    """
    missing = missing_reporters(report_to)
    if missing:
        packages = " ".join(REPORTER_PACKAGES.get(name, name) for name in missing)
        raise ValueError(
            f"--report_to {' '.join(report_to)}: {', '.join(missing)} is not installed; `pip install {packages}`, "
            "or pass --report_to none (the logs then stay in trainer_state.json)."
        )


def check_before_loading(
    argv: Sequence[str] | None,
    *,
    smoke_settings: Mapping[str, Any] | None = None,
    checks: Callable[[dict[str, list[str]]], None] | None = None,
) -> dict[str, list[str]]:
    """The checks a recipe runs before importing torch or transformers; returns the merged values.

    The flatness fields' ranges, the reporters' packages, then the recipe's own ``checks(values)``. Each failure is
    a `ValueError` of one line (`hf_flatbias.cli.run_recipe` prints it and exits with 2). What passes here is still
    parsed and validated in full afterwards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    values = merged_values(argv, smoke_settings)
    if "-h" in argv or "--help" in argv:
        return values  # the full parser prints the help
    for name in FLATNESS_FIELD_RULES:
        if values.get(name):
            problem = flatness_value_error(name, values[name][-1])
            if problem:
                raise ValueError(problem)
    if values.get("report_to"):
        check_reporters(values["report_to"])
    if checks is not None:
        checks(values)
    return values
