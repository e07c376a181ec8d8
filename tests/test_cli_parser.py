"""The ``hf-flatbias`` parser: listed commands, lazy imports, one flag style, the trace command's defaults."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import hf_flatbias
from hf_flatbias import cli, commands
from hf_flatbias.constants import DEFAULT_BATCH_SIZE, RECOMMENDED_N_DRAWS

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("torch", "transformers", "datasets", "accelerate", "huggingface_hub")


def run_python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (this process has torch imported already) and return its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    completed = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def subparsers_of(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_help_and_every_command_help_import_neither_torch_nor_transformers():
    code = f"""
import contextlib, io, json, sys
from hf_flatbias.cli import COMMANDS, main
imported = {{}}
for argv in [["--help"]] + [[command.__name__.rsplit(".", 1)[1], "--help"] for command in COMMANDS]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
    imported[" ".join(argv)] = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY_MODULES!r})
print(json.dumps(imported))
"""
    imported = json.loads(run_python(code))
    assert len(imported) == 1 + len(cli.COMMANDS)
    assert imported == {argv: [] for argv in imported}


def test_importing_the_package_is_lazy_and_every_public_name_resolves():
    imported = json.loads(run_python("import json, sys, hf_flatbias; print(json.dumps(sorted(sys.modules)))"))
    assert [module for module in imported if module.split(".")[0] in HEAVY_MODULES] == []
    for name in hf_flatbias.__all__:
        assert getattr(hf_flatbias, name) is not None, name
        assert name in dir(hf_flatbias)
    with pytest.raises(AttributeError, match="no attribute 'FlatBiasTrainr'"):
        hf_flatbias.FlatBiasTrainr  # noqa: B018


def test_type_checking_imports_match_the_lazy_table():
    """The imports type checkers read and the table `__getattr__` reads name the same things."""
    tree = ast.parse(Path(hf_flatbias.__file__).read_text())
    (block,) = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    for_type_checkers = {
        (node.module, alias.name) for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    lazy = {(module, name) for module, names in hf_flatbias._import_structure.items() for name in names}
    assert for_type_checkers == lazy


def test_commands_are_listed_in_help_order_and_none_is_forgotten():
    assert list(subparsers_of(cli.build_parser())) == ["trace", "card", "compare", "select", "glue", "demo"]
    with_register = {
        info.name
        for info in pkgutil.iter_modules(commands.__path__)
        if hasattr(importlib.import_module(f"{commands.__name__}.{info.name}"), "register")
    }
    assert with_register == {command.__name__.rsplit(".", 1)[1] for command in cli.COMMANDS}


def test_every_flag_is_kebab_case():
    parsers = {"hf-flatbias": cli.build_parser(), **subparsers_of(cli.build_parser())}
    flags = {
        (name, flag) for name, parser in parsers.items() for action in parser._actions for flag in action.option_strings
    }
    assert ("glue", "--data-dir") in flags and ("trace", "--n-contexts") in flags
    assert [(name, flag) for name, flag in sorted(flags) if "_" in flag] == []


def test_old_underscore_spelling_is_refused_with_the_new_one_suggested(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["glue", "some/model", "--task", "rte", "--data_dir", "glue_data"])
    assert exit_info.value.code == 2
    assert "--data_dir" in capsys.readouterr().err


def test_trace_defaults_to_the_recommended_number_of_draws():
    args = cli.build_parser().parse_args(["trace", "user/model", "--data", "data.jsonl"])
    assert args.n_draws == RECOMMENDED_N_DRAWS == 2
    assert args.batch_size == DEFAULT_BATCH_SIZE


def test_sam_radius_has_one_spelling_and_one_default():
    from hf_flatbias.config import FlatBiasConfig
    from hf_flatbias.constants import DEFAULT_SAM_RHO

    parser = cli.build_parser()
    trace = parser.parse_args(["trace", "user/model", "--data", "data.jsonl"])
    demo = parser.parse_args(["demo"])
    assert trace.sam_rho == demo.sam_rho == FlatBiasConfig("out").sam_rho == DEFAULT_SAM_RHO
    assert parser.parse_args(["demo", "--sam-rho", "0.2"]).sam_rho == 0.2


@pytest.mark.parametrize(
    "earlier, flag",
    [
        (["--rho", "0.3"], "--sam-rho"),
        (["--trace-contexts", "8"], "--n-contexts"),
        (["--trace-contexts=8"], "--n-contexts"),
    ],
)
def test_the_demos_earlier_spellings_are_refused_in_one_line_naming_the_flag(earlier, flag, capsys):
    """One spelling of the SAM radius and of the trace's context count, as `hf-flatbias trace` and the callback
    have them (issue 58): the demo's earlier ones are neither read silently nor listed."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *earlier])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and f"pass {flag}" in error, error
    assert earlier[0].split("=")[0] not in subparsers_of(cli.build_parser())["demo"].format_help()


def test_the_trace_and_the_demo_spell_the_context_count_alike():
    parser = cli.build_parser()
    assert parser.parse_args(["demo", "--n-contexts", "8"]).n_contexts == 8
    assert parser.parse_args(["trace", "user/model", "--data", "d.jsonl", "--n-contexts", "8"]).n_contexts == 8


def test_the_glue_command_and_finetune_glue_share_their_defaults():
    import dataclasses

    from hf_flatbias.glue import GlueArguments, GlueConfig

    args = cli.build_parser().parse_args(["glue", "user/model", "--task", "sst2"])
    arguments, config = GlueArguments(), GlueConfig()
    assert args.seeds == arguments.seeds and args.max_length == arguments.max_length
    assert args.batch_size == config.per_device_train_batch_size
    assert args.learning_rate is None and config.learning_rate_for("full") == 2e-5  # the mode chooses it
    epochs = {f.name: f.default for f in dataclasses.fields(GlueConfig)}["num_train_epochs"]
    assert args.num_train_epochs == epochs
