"""Bad command-line input: one line naming the fix, at once; bugs keep their traceback; closed pipes are quiet."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_flatbias import cli
from hf_flatbias.commands import card, select
from hf_flatbias.commands.paths import existing_local_path, local_path_or_hub_id, looks_like_local_path

REPO_ROOT = Path(__file__).resolve().parents[1]

MISTYPED = {
    "trace": ["trace", "./runs/sam/checkpoint-50", "--data", "data.jsonl"],
    "card": ["card", "runs/sam/checkpoint-50"],
    "compare": ["compare", "user/model", "~/runs/no-such-run"],
    "select": ["select", "runs/sam"],
    "glue": ["glue", "/no/such/checkpoint", "--task", "rte"],
}


@pytest.mark.parametrize(
    "value,local",
    [
        ("./ckpt", True),
        ("../ckpt", True),
        ("/abs/ckpt", True),
        ("~/ckpt", True),
        ("runs/sam/checkpoint-50", True),  # a Hub id has at most one slash
        ("C:\\runs\\sam", True),
        ("runs\\sam", True),
        ("user/model", False),
        ("bert-base-uncased", False),
        ("google-bert/bert-base-uncased", False),
    ],
)
def test_what_looks_like_a_local_path(value, local):
    assert looks_like_local_path(value) is local


def test_a_folder_that_exists_in_part_was_meant_locally(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_like_local_path("runs/sam")
    (tmp_path / "runs").mkdir()
    assert looks_like_local_path("runs/sam")


def test_file_suffixes_mark_bare_file_names_as_local():
    assert looks_like_local_path("README.md", file_suffixes=(".md",))
    assert looks_like_local_path("data.JSONL", file_suffixes=(".jsonl",))
    assert not looks_like_local_path("README.md")


def test_hub_ids_pass_and_existing_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ckpt").mkdir()
    assert local_path_or_hub_id("user/model", "MODEL") == "user/model"
    assert local_path_or_hub_id("~/ckpt", "MODEL") == str(tmp_path / "ckpt")
    assert existing_local_path("~/ckpt", "SOURCE") == str(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match=r"^MODEL ~/other: no such file or folder"):
        local_path_or_hub_id("~/other", "MODEL")
    with pytest.raises(FileNotFoundError, match=r"^SOURCE user/model: no such file or folder"):
        existing_local_path("user/model", "SOURCE")  # select reads local files only


@pytest.mark.parametrize("command", sorted(MISTYPED))
def test_mistyped_path_is_one_line_naming_it(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(MISTYPED[command]) == 2
    captured = capsys.readouterr()
    named = next(arg for arg in MISTYPED[command][1:] if arg.startswith((".", "/", "~", "runs")))
    assert captured.err == f"hf-flatbias {command}: error: {captured.err.split(': error: ', 1)[1]}"
    assert captured.err.count("\n") == 1 and named in captured.err and "no such file or folder" in captured.err
    assert captured.out == "" and list(tmp_path.iterdir()) == []


def test_mistyped_paths_fail_before_anything_is_loaded(tmp_path):
    """In a fresh interpreter: the error comes before torch, transformers or the Hub client are imported."""
    code = f"""
import contextlib, io, json, sys
from hf_flatbias.cli import main
results = {{}}
for name, argv in {MISTYPED!r}.items():
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(argv)
    results[name] = [code, err.getvalue()]
heavy = ("torch", "transformers", "datasets", "huggingface_hub")
results["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
print(json.dumps(results))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    completed = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    results = json.loads(completed.stdout)
    assert results.pop("imported") == []
    for name, (code, err) in results.items():
        assert code == 2 and "no such file or folder" in err, name


def test_bad_values_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    def rejects(args):
        raise ValueError("--loss-tolerance must be >= 0 (got -1).")

    monkeypatch.setattr(select, "run", rejects)
    assert cli.main(["select", "records.json"]) == 2
    assert capsys.readouterr().err == "hf-flatbias select: error: --loss-tolerance must be >= 0 (got -1).\n"
    with pytest.raises(ValueError, match="loss-tolerance"):
        cli.main(["--debug", "select", "records.json"])


def test_bugs_keep_their_traceback(monkeypatch):
    def broken(args):
        return args.no_such_attribute

    monkeypatch.setattr(card, "run", broken)
    with pytest.raises(AttributeError, match="no_such_attribute"):
        cli.main(["card", "user/model"])


def _closed_pipe(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` with its stdout a pipe whose reader has gone (as in ``... | head -1``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()  # before the child, still starting, writes anything
    stderr = process.stderr.read()
    process.wait(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, "", stderr)


def test_closed_pipe_exits_quietly():
    code = """
from hf_flatbias import cli
from hf_flatbias.commands import card
card.run = lambda args: print("| field | value |\\n" * 10000)
raise SystemExit(cli.main(["card", "user/model"]))
"""
    completed = _closed_pipe(code)
    assert (completed.returncode, completed.stderr) == (1, "")


def test_without_the_handling_a_closed_pipe_prints_a_traceback():
    """The check above can fail: the same output written without `cli.main` raises BrokenPipeError."""
    completed = _closed_pipe('print("| field | value |\\n" * 10000)')
    assert "BrokenPipeError" in completed.stderr


@pytest.mark.slow  # the card command imports transformers: about 15 s on the shared machine
def test_card_json_into_a_closed_pipe(tmp_path):
    from hf_flatbias.modelcard import FlatnessCard

    FlatnessCard(model_name="tiny", method="sam", sam_rho=0.05, hessian_trace=1.0).save(tmp_path)
    completed = _closed_pipe(
        f"from hf_flatbias.cli import main; raise SystemExit(main(['card', {str(tmp_path)!r}, '--json']))"
    )
    assert (completed.returncode, completed.stderr) == (1, "")


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--noise-sigmas", "abc", "argument --noise-sigmas: expected comma-separated numbers such as 0.01,0.05"),
        ("--quantization-bits", "4.5", "argument --quantization-bits: expected comma-separated whole numbers such as "),
        ("--quantization-group-size", "x", "argument --quantization-group-size: expected a whole number or none"),
        ("--eigenvalue-fd-step", "x", "argument --eigenvalue-fd-step: expected a number or none"),
        ("--noise-draws", "2.5", "argument --noise-draws: expected a whole number"),
        ("--n-draws", "abc", "argument --n-draws: expected a whole number (got 'abc')"),
        ("--n-contexts", "1e3", "argument --n-contexts: expected a whole number (got '1e3')"),
    ],
)
def test_a_flag_of_the_wrong_form_is_one_line_naming_the_form(flag, value, expected, capsys):
    """Issue 58, item 8: before, argparse named the private type function (``invalid _floats value: 'abc'``) after
    the command's 35-line usage."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["trace", "user/model", "--data", "data.jsonl", flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"hf-flatbias trace: error: {expected}") and "usage" not in err, err
    assert "--help" in err


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["demo", "--steps", "1e3"], "hf-flatbias demo: error: argument --steps: expected a whole number (got '1e3')"),
        (["demo", "--sam-rho", "big"], "hf-flatbias demo: error: argument --sam-rho: expected a number (got 'big')"),
        (["glue", "--seeds", "0", "x"], "hf-flatbias glue: error: argument --seeds: expected a whole number (got 'x')"),
        (["glue", "--num-train-epochs", "3,5"], "argument --num-train-epochs: expected a number (got '3,5')"),
        (["select", "--loss-tolerance", "1%"], "argument --loss-tolerance: expected a number (got '1%')"),
    ],
)
def test_a_plain_number_flag_of_any_command_is_one_line_naming_the_form(argv, expected, capsys):
    """argparse's own ``argument --steps: invalid int value: '1e3'`` named Python's type, not the form a user types."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage" not in err, err
    assert expected in err and err.rstrip().endswith(f"(hf-flatbias {argv[0]} --help lists the flags)"), err


@dataclasses.dataclass
class _RecipeArguments:
    steps: int = 1


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--steps"], "argument --steps: expected one argument (--help lists the flags)"),  # the dataclasses' parser
        (["--config"], "argument --config: expected one argument (--help lists the flags)"),  # the --config pre-parser
    ],
)
def test_a_recipes_flag_error_is_the_same_parsers_line_raised_for_run_recipe(argv, expected):
    """The dataclass recipes parse with the command line's `OneLineErrorParser`, which raises the line (run_recipe
    prints it after the recipe's name) instead of printing it with the parser's own name and exiting."""
    from hf_flatbias.recipe_args import parse_dataclass_args

    with pytest.raises(ValueError) as error:
        parse_dataclass_args([_RecipeArguments], argv)
    assert str(error.value) == expected


def test_a_missing_command_is_one_line_naming_help(capsys):
    with pytest.raises(SystemExit):
        cli.main([])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "hf-flatbias --help" in err, err
