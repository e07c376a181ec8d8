"""Issue 39, the rest: the bad inputs of a newcomer's third pass, each refused in one line that names the fix, before
anything costly loads, and never a silent wrong answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_flatbias import cli
from tests.conftest import REPO
from tests.test_user_errors import CHEAP_CHECKS, WORDS, _masked_lm_folder, _one_error_line, _write_rows

POSITIONS = 32  # max_position_embeddings of `_masked_lm_folder`'s model


@pytest.fixture(scope="module")
def language_model(tmp_path_factory) -> Path:
    return _masked_lm_folder(tmp_path_factory.mktemp("models") / "mlm")


def _trace(model: Path, data: Path, output: Path, *extra: str) -> int:
    argv = ["trace", str(model), "--data", str(data), "--n-contexts", "4", "--no-progress", "--no-by-group"]
    return cli.main([*argv, "--output", str(output), *extra])


# ---------------------------------------------------------------------------------------------- trace's token ids


def test_rows_longer_than_the_models_positions_are_cut_with_a_notice(language_model, tmp_path, capsys):
    """Before: a 70-line traceback ("The expanded size of the tensor (100) must match the existing size")."""
    long_rows = [{"input_ids": [2, *[5 + (i + j) % 20 for j in range(98)], 3]} for i in range(4)]
    cut_rows = [{"input_ids": row["input_ids"][:POSITIONS]} for row in long_rows]
    assert _trace(language_model, _write_rows(tmp_path / "long.jsonl", long_rows), tmp_path / "long.json") == 0
    err = capsys.readouterr().err
    assert f"4 of 4 rows of {tmp_path / 'long.jsonl'} hold more than {POSITIONS} token ids (the model's" in err
    # the same number as rows cut by hand: the cut is the only change
    assert _trace(language_model, _write_rows(tmp_path / "cut.jsonl", cut_rows), tmp_path / "cut.json") == 0
    assert "cut to" not in capsys.readouterr().err
    long, cut = (json.loads((tmp_path / f"{name}.json").read_text())["estimate"] for name in ("long", "cut"))
    assert long["mean"] == cut["mean"]
    # --max-length cuts ids as it cuts text, and says so
    assert _trace(language_model, tmp_path / "cut.jsonl", tmp_path / "ten.json", "--max-length", "10") == 0
    assert "hold more than 10 token ids (--max-length 10); cut to 10." in capsys.readouterr().err


def test_text_longer_than_the_models_positions_is_cut_at_them(language_model, tmp_path, capsys):
    text = tmp_path / "long.txt"
    text.write_text("".join(" ".join(WORDS * 3) + "\n" for _ in range(4)))  # 60 words a line, 32 positions
    assert _trace(language_model, text, tmp_path / "trace.json") == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    "ids,expected",
    [
        ([2, 5.5, 6.0, 3], "input_ids holds 5.5, not an integer token id; write the ids as integers"),
        (["2", "5", "3"], "input_ids holds '2', not an integer token id"),
        ("2 5 6 3", "input_ids is '2 5 6 3', not a list of token ids; write it as a list of integers"),
    ],
)
def test_token_ids_that_are_not_integers_are_refused(language_model, tmp_path, capsys, ids, expected):
    """Before: floats were truncated silently (5.5 read as 5) and a string gave `invalid literal for int()`."""
    data = _write_rows(tmp_path / "rows.jsonl", [{"input_ids": ids}] * 4)
    assert _trace(language_model, data, tmp_path / "trace.json") == 2
    line = _one_error_line(capsys.readouterr().err, "hf-flatbias trace")
    assert f"Row 0 of {data}: {expected}" in line
    assert not (tmp_path / "trace.json").exists()


# ---------------------------------------------------------------------------------------------- bounded requests


@pytest.mark.parametrize(
    "flag,value,expected",
    [
        ("--n-draws", "1000000000", "--n-draws 1000000000 is outside the sane range 1..10,000 (2 is recommended"),
        ("--n-contexts", "1000000000", "--n-contexts 1000000000 is outside the sane range 1..1,000,000"),
    ],
)
def test_a_request_beyond_the_sane_range_is_one_line(language_model, tmp_path, capsys, flag, value, expected):
    """Before: --n-draws 1000000000 was accepted; the process grew to 14.5 GB and the kernel killed it."""
    data = _write_rows(tmp_path / "rows.jsonl", [{"input_ids": [2, 5, 6, 3]}])
    argv = ["trace", str(language_model), "--data", str(data), flag, value, "--output", str(tmp_path / "t.json")]
    assert cli.main(argv) == 2
    assert expected in _one_error_line(capsys.readouterr().err, "hf-flatbias trace")


def test_a_request_whose_draws_outgrow_the_memory_is_refused_before_allocating():
    from hf_flatbias.commands.trace_inputs import check_request_size, request_bytes

    # 1,000 contexts x 10,000 draws hold 80 MB of float64 values at least
    assert request_bytes(1000, 10_000, 128, 32) >= 8 * 1000 * 10_000
    with pytest.raises(ValueError, match=r"--n-contexts 1000 x --n-draws 10000 needs at least 0\.1 GiB .* lower"):
        check_request_size(1000, 10_000, 128, 32, available=2**20)
    check_request_size(1000, 10_000, 128, 32, available=2**30)
    check_request_size(1000, 2, 128, "auto")  # the defaults, against this machine's memory


# ---------------------------------------------------------------------------------------------- impossible cards


def _card(folder: Path, edit: tuple[str, str] | None = None, **fields) -> Path:
    """A card saved by FlatnessCard, then one line of its ``flatness:`` block edited by hand, as a user might."""
    from hf_flatbias.modelcard import FlatnessCard

    values = {"hessian_trace": 12.5, "hessian_trace_stderr": 0.5, "trace_step": 100, "estimator": "per_sample"}
    values.update(pretraining_loss=2.5, global_step=100, method="sam", sam_rho=0.05)
    FlatnessCard("run", **{**values, **fields}).save(folder)
    if edit is not None:
        readme = folder / "README.md"
        old, new = edit
        assert f"\n  {old}\n" in readme.read_text()
        readme.write_text(readme.read_text().replace(f"\n  {old}\n", f"\n  {new}\n"))
    return folder


IMPOSSIBLE_CARDS = {
    "negative Fisher trace": (
        ("hessian_trace: 12.5", "hessian_trace: -5.0"),
        "hessian_trace is -5.0, but a Fisher trace Tr(F) (estimator per_sample) cannot be negative",
    ),
    "negative standard error": (
        ("hessian_trace_stderr: 0.5", "hessian_trace_stderr: -1.0"),
        "hessian_trace_stderr must be >= 0 (got -1.0): a standard error is not negative",
    ),
    "negative pre-training loss": (
        ("pretraining_loss: 2.5", "pretraining_loss: -3.0"),
        "pretraining_loss must be >= 0 (got -3.0): a cross-entropy is not negative",
    ),
    "trace after the last step": (
        ("trace_step: 100", "trace_step: 900"),
        "trace_step 900 is past the run's last step, global_step 100",
    ),
}


@pytest.mark.parametrize("name", sorted(IMPOSSIBLE_CARDS))
def test_an_impossible_card_is_one_line_in_card_and_compare(name, tmp_path, capsys):
    """Before: `card` printed `-5 ± -1` and `compare --sort trace` ranked the card flattest."""
    edit, expected = IMPOSSIBLE_CARDS[name]
    bad, good = _card(tmp_path / "bad", edit), _card(tmp_path / "good")
    assert cli.main(["card", str(bad)]) == 2
    captured = capsys.readouterr()
    assert expected in _one_error_line(captured.err, "hf-flatbias card") and captured.out == ""
    assert cli.main(["compare", str(good), str(bad), "--sort", "trace"]) == 2
    captured = capsys.readouterr()
    assert expected in _one_error_line(captured.err, "hf-flatbias compare") and captured.out == ""
    assert f"{bad / 'README.md'}: " in captured.err and "Fix the card's metadata" in captured.err


def test_a_negative_hutchinson_trace_is_a_possible_card(tmp_path, capsys):
    """The data-label Hessian's trace is negative away from the optimum (-73.0 against a Fisher trace of 82.1 on a
    tiny untrained BERT): a card of the hutchinson estimator may hold it, and writing one is not refused."""
    for estimator in ("hutchinson", "hutchpp"):
        folder = _card(tmp_path / estimator, hessian_trace=-73.0, estimator=estimator)
        assert cli.main(["card", str(folder)]) == 0
        assert "| Hessian trace Tr(H) ± stderr | -73 ± 0.5 |" in capsys.readouterr().out
    from hf_flatbias.modelcard import FlatnessCard

    with pytest.raises(ValueError, match="a Fisher trace Tr\\(F\\) \\(estimator naive\\) cannot be negative"):
        FlatnessCard("run", hessian_trace=-1.0, estimator="naive").save(tmp_path / "naive")
    assert not (tmp_path / "naive").exists()


# ---------------------------------------------------------------------------------------------- checks before loading


def _damaged_checkpoints(folder: Path, model: Path) -> tuple[Path, Path]:
    """A checkpoint whose config.json is not JSON, and a LoRA adapter whose base folder has gone."""
    garbage = folder / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text("not json {")
    adapter = folder / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(folder / "gone")}))
    return garbage, adapter


def test_checks_that_waited_for_a_full_load_come_before_torch(language_model, tmp_path):
    """Issue 39: each of these took 10-13 CPU seconds (torch, transformers and datasets loaded first, the demo's
    "writing to ..." printed); in one process they now all fail with neither torch nor transformers imported."""
    empty, header = tmp_path / "empty.txt", tmp_path / "header.csv"
    empty.write_text("")
    header.write_text("text\n")
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    (sst2 / "train.csv").write_text("")
    (sst2 / "validation.csv").write_text("sentence,label\nw1 w2,0\n")
    garbage, adapter = _damaged_checkpoints(tmp_path, language_model)
    (tmp_path / "regular_file").write_text("kept\n")
    trace = ["trace", str(language_model), "--output", str(tmp_path / "t.json"), "--data"]
    cases = {
        "empty data file": ([*trace, str(empty)], f"{empty} is empty; put text in it, or point --data at another"),
        "header-only data file": ([*trace, str(header)], f"{header} has a header line and no rows"),
        "empty GLUE file": (
            ["glue", str(language_model), "--task", "sst2", "--data-dir", str(sst2)],
            f"{sst2 / 'train.csv'} is empty",
        ),
        "unknown GLUE task": (["glue", str(language_model), "--task", "sst3"], "Unknown GLUE task 'sst3'"),
        "GLUE task offline without data": (["glue", str(language_model), "--task", "rte"], "--data-dir on the command"),
        "garbage config.json in trace": (
            ["trace", str(garbage), "--data", str(empty)],
            f"{garbage / 'config.json'} is not a valid JSON file",
        ),
        "garbage config.json in glue": (["glue", str(garbage), "--task", "sst2"], "is not a valid JSON file"),
        "adapter without its base": (
            ["trace", str(adapter), "--data", str(empty)],
            f"{adapter / 'adapter_config.json'}, base_model_name_or_path {tmp_path / 'gone'}: no such file or folder",
        ),
        "n-draws beyond the range": ([*trace, str(empty), "--n-draws", "1000000000"], "outside the sane range"),
        "demo below a regular file": (
            ["demo", "--output-dir", str(tmp_path / "regular_file" / "demo")],
            "regular_file is a file, so no folder can be made there",
        ),
    }
    completed = subprocess.run(
        [sys.executable, "-c", CHEAP_CHECKS, json.dumps([argv for argv, _ in cases.values()])],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
        timeout=120,
    )
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["codes"] == [2] * len(cases), completed.stderr
    assert not report["torch"] and not report["transformers"]
    errors = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(errors) == len(cases) and "Traceback" not in completed.stderr, completed.stderr
    for (name, (argv, expected)), line in zip(cases.items(), errors, strict=True):
        assert line.startswith(f"hf-flatbias {argv[0]}: error: ") and expected in line, (name, line)
    assert "writing to" not in completed.stdout
    assert (tmp_path / "regular_file").read_text() == "kept\n" and not (tmp_path / "t.json").exists()


# ---------------------------------------------------------------------------------------------- smaller items


@pytest.fixture
def hub(tmp_path, monkeypatch):
    from tests.helpers.hub_server import HubServer, point_hub_client_at

    with HubServer() as server:
        point_hub_client_at(server.url, monkeypatch, str(tmp_path / "hf_home"))
        yield server


def test_a_missing_hub_repo_revision_or_card_is_one_line(hub, tmp_path, capsys):
    """Before: huggingface_hub's 404 text, seven lines, printed after `error:`."""
    from huggingface_hub import HfApi

    HfApi().create_repo("user/no-card")
    _card(tmp_path / "card")
    HfApi().create_repo("user/card")
    HfApi().upload_folder(repo_id="user/card", folder_path=tmp_path / "card", commit_message="card")
    cases = [
        (["card", "user/never-created"], "user/never-created: no such repository on the Hub"),
        (["compare", "user/card", "user/never-created"], "user/never-created: no such repository on the Hub"),
        (["card", "user/card", "--revision", "v9"], "user/card has no revision 'v9' on the Hub"),
        (["card", "user/no-card"], "user/no-card has no README.md on the Hub"),
    ]
    for argv, expected in cases:
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and expected in _one_error_line(captured.err, f"hf-flatbias {argv[0]}")
    assert cli.main(["card", "user/card"]) == 0  # the Hub itself works


def test_offline_card_and_compare_say_that_hf_hub_offline_is_set(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for command in (["card", "user/model"], ["compare", "user/model"]):
        assert cli.main(command) == 2
        line = _one_error_line(capsys.readouterr().err, f"hf-flatbias {command[0]}")
        assert "user/model: HF_HUB_OFFLINE is set, so nothing is downloaded" in line and "unset HF_HUB_OFFLINE" in line


def test_the_demos_output_folder_as_a_model_or_card_names_its_runs(language_model, tmp_path, capsys):
    demo = tmp_path / "flatbias-demo"
    for run in ("adamw", "sam"):
        _card(demo / run)
    (demo / "demo.json").write_text("{}")
    data = _write_rows(tmp_path / "rows.jsonl", [{"input_ids": [2, 5, 6, 3]}])
    for argv in (
        ["card", str(demo)],
        ["compare", str(demo / "sam"), str(demo)],
        ["trace", str(demo), "--data", str(data), "--output", str(tmp_path / "t.json")],
        ["glue", str(demo), "--task", "sst2"],
        ["select", str(demo)],
    ):
        assert cli.main(argv) == 2
        line = _one_error_line(capsys.readouterr().err, f"hf-flatbias {argv[0]}")
        assert (
            f"{demo} is the demo's output folder, one run per optimizer: pick {demo / 'adamw'} or {demo / 'sam'}."
            in line
        )


def test_demo_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in {
        "--output-dir": "flatbias-demo", "--sam-rho": "0.05", "--steps": "600", "--eval-every": "100",
        "--n-train": "20000", "--n-contexts": "256", "--n-probe": "500", "--seed": "0",
    }.items():  # fmt: skip
        assert flag in text and f"(default: {default})" in text.split(flag, 2)[-1].split(" --", 1)[0], flag


def _llama_folder(folder: Path) -> Path:
    """A tiny Llama saved without a tokenizer, as a training script that forgot it leaves one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_llama_folder_without_a_tokenizer_names_the_tokenizer_flag(tmp_path, capsys):
    """Before: "Couldn't instantiate the backend tokenizer from one of: ..."."""
    from hf_flatbias.synthetic import make_tokenizer

    _llama_folder(tmp_path / "llama")
    make_tokenizer(WORDS).save_pretrained(tmp_path / "tokenizer")
    text = tmp_path / "text.txt"
    text.write_text("".join(" ".join(WORDS[i : i + 6]) + "\n" for i in range(8)))
    argv = ["trace", str(tmp_path / "llama"), "--data", str(text), "--n-contexts", "4", "--no-progress"]
    assert cli.main([*argv, "--output", str(tmp_path / "t.json")]) == 2
    line = _one_error_line(capsys.readouterr().err, "hf-flatbias trace")
    assert f"{tmp_path / 'llama'} holds no tokenizer" in line and "pass --tokenizer" in line
    assert cli.main([*argv, "--tokenizer", str(tmp_path / "tokenizer"), "--output", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["estimate"]["n_contexts"] == 4


def test_debug_is_read_after_the_command_too(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert cli.main(["card", missing]) == 2
    for argv in (["--debug", "card", missing], ["card", missing, "--debug"]):
        with pytest.raises(FileNotFoundError, match="no such file or folder"):
            cli.main(argv)


def test_resuming_a_bert_reports_real_missing_keys_only(tmp_path, monkeypatch):
    """transformers 5 saves BERT without its tied decoder and warned "missing keys ... decoder.weight" on resume."""
    import transformers.trainer
    from torch.nn.modules.module import _IncompatibleKeys
    from transformers import BertForMaskedLM

    from hf_flatbias import FlatBiasTrainer
    from hf_flatbias.checkpoints import tied_missing_keys
    from tests.helpers.tiny_models import flatbias_config, randomly_masked_rows, tiny_bert_config, tiny_mlm

    decoder = ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]
    trainer = FlatBiasTrainer(model=tiny_mlm(), args=flatbias_config(tmp_path), train_dataset=randomly_masked_rows())
    warned: list[str] = []
    monkeypatch.setattr(transformers.trainer.logger, "warning", warned.append)
    trainer._issue_warnings_after_load(_IncompatibleKeys(decoder, []))
    assert warned == []
    trainer._issue_warnings_after_load(_IncompatibleKeys([*decoder, "bert.pooler.dense.weight"], []))
    assert warned == ["There were missing keys in the checkpoint model loaded: ['bert.pooler.dense.weight']."]
    # untied: the decoder's weight is a weight of its own, and its absence is reported
    untied = BertForMaskedLM(tiny_bert_config(tie_word_embeddings=False))
    assert "cls.predictions.decoder.weight" not in tied_missing_keys(untied, decoder)
    # a tied key whose source is missing too is not covered by it
    missing_source = [*decoder, "bert.embeddings.word_embeddings.weight"]
    assert "cls.predictions.decoder.weight" not in tied_missing_keys(tiny_mlm(), missing_source)


def test_the_demos_last_line_claims_tensorboard_logs_only_when_written(tmp_path, monkeypatch):
    from hf_flatbias.commands import demo

    monkeypatch.setattr(demo, "_tensorboard_installed", lambda: True)
    assert (
        demo.tensorboard_line(tmp_path)
        == f"TensorBoard logs: none written under {tmp_path}, although tensorboard is installed"
    )
    (tmp_path / "sam" / "runs").mkdir(parents=True)
    (tmp_path / "sam" / "runs" / "events.out.tfevents.1.host").write_bytes(b"")
    assert demo.tensorboard_line(tmp_path) == f"TensorBoard logs: tensorboard --logdir {tmp_path}"
    monkeypatch.setattr(demo, "_tensorboard_installed", lambda: False)
    assert "none written (tensorboard is not installed" in demo.tensorboard_line(tmp_path / "sam" / "other")


# ---------------------------------------------------------------------------------------------- all of them at once


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def test_every_bad_input_of_issue_39_is_one_line_and_loses_nothing(language_model, tmp_path):
    """Every command-line bad input of issue 39 in one process: exit 2, one error line, no traceback, and every file
    written before (the inputs, an earlier result named by --output, a card, the demo's runs) byte for byte the
    same after. The recipes' bad inputs run in test_user_errors.py; the Hub's 404s, which need a server, above."""
    from tests.test_user_errors import BAD_INPUTS, _recipe_outputs

    fixture = tmp_path / "fixture"
    fixture.mkdir()
    earlier = fixture / "earlier.json"
    earlier_result = {"model": "m", "data": "d", "split": None, "seed": 0, "device": "cpu", "estimate": {"mean": 1.0}}
    earlier.write_text(json.dumps(earlier_result) + "\n")  # a trace result, which --output may write over
    rows = {
        "floats": [{"input_ids": [2, 5.5, 6.0, 3]}],
        "string": [{"input_ids": "2 5 6 3"}],
        "strings": [{"input_ids": ["2", "5", "3"]}],
        "ok": [{"input_ids": [2, 5, 6, 3]}],
    }
    data = {name: _write_rows(fixture / f"{name}.jsonl", content) for name, content in rows.items()}
    (fixture / "empty.txt").write_text("")
    (fixture / "header.csv").write_text("text\n")
    (fixture / "regular_file").write_text("kept\n")
    garbage, adapter = _damaged_checkpoints(fixture, language_model)
    cards = {name: _card(fixture / name.replace(" ", "_"), edit) for name, (edit, _) in IMPOSSIBLE_CARDS.items()}
    good_card = _card(fixture / "good_card")
    demo = fixture / "flatbias-demo"
    for run in ("adamw", "sam"):
        _card(demo / run)
    (demo / "demo.json").write_text("{}")
    llama = _llama_folder(fixture / "llama")
    (fixture / "text.txt").write_text("w1 w2 w3\nw4 w5 w6\n")

    def trace(source, *extra):
        return ["trace", str(language_model), "--data", str(source), "--output", str(earlier), *extra]

    cases = {
        "float token ids": (trace(data["floats"]), "input_ids holds 5.5, not an integer token id"),
        "token ids as a string": (trace(data["string"]), "input_ids is '2 5 6 3', not a list of token ids"),
        "token ids as strings": (trace(data["strings"]), "input_ids holds '2', not an integer token id"),
        "a billion draws": (trace(data["ok"], "--n-draws", "1000000000"), "outside the sane range 1..10,000"),
        "a billion contexts": (trace(data["ok"], "--n-contexts", "1000000000"), "outside the sane range 1..1,000,000"),
        **{f"card with a {name}": (["card", str(folder)], IMPOSSIBLE_CARDS[name][1]) for name, folder in cards.items()},
        **{
            f"compare with a {name}": (
                ["compare", str(good_card), str(folder), "--sort", "trace"],
                IMPOSSIBLE_CARDS[name][1],
            )
            for name, folder in cards.items()
        },
        "empty data file": (trace(fixture / "empty.txt"), "is empty; put text in it"),
        "header-only data file": (trace(fixture / "header.csv"), "has a header line and no rows"),
        "unknown GLUE task": (["glue", str(language_model), "--task", "sst3"], "Unknown GLUE task 'sst3'"),
        "GLUE task offline without data": (
            ["glue", str(language_model), "--task", "rte"],
            "needs the Hugging Face Hub",
        ),
        "garbage config.json (trace)": (["trace", str(garbage), "--data", str(data["ok"])], "is not a valid JSON file"),
        "garbage config.json (glue)": (["glue", str(garbage), "--task", "sst2"], "is not a valid JSON file"),
        "demo below a regular file": (
            ["demo", "--output-dir", str(fixture / "regular_file" / "demo")],
            "regular_file is a file, so no folder can be made there",
        ),
        "offline card": (["card", "user/model"], "HF_HUB_OFFLINE is set"),
        "offline compare": (["compare", str(good_card), "user/model"], "HF_HUB_OFFLINE is set"),
        "the demo's folder as a card": (["card", str(demo)], "is the demo's output folder"),
        "the demo's folder as a model": (trace(data["ok"])[:1] + [str(demo)] + trace(data["ok"])[2:], "pick"),
        "a Llama folder without a tokenizer": (
            ["trace", str(llama), "--data", str(fixture / "text.txt"), "--output", str(earlier)],
            "holds no tokenizer (tokenizer.json, tokenizer_config.json, vocab.txt): pass --tokenizer",
        ),
        "an adapter whose base is gone": (
            ["trace", str(adapter), "--data", str(data["ok"])],
            "base_model_name_or_path",
        ),
    }
    before = _digests(fixture)
    runs = [(name, "cli", argv) for name, (argv, _) in cases.items()]
    completed = subprocess.run(
        [sys.executable, "-c", BAD_INPUTS, json.dumps(runs)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")},
        timeout=300,
    )
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    outputs = _recipe_outputs(completed)
    assert list(outputs) == list(cases)
    for name, (argv, expected) in cases.items():
        text, code = outputs[name]
        assert code == 2, (name, text)
        assert expected in _one_error_line(text, f"hf-flatbias {argv[0]}"), (name, text)
    assert completed.stdout == ""  # no card shown, no table ranked, no "writing to ..."
    assert _digests(fixture) == before


def test_the_library_bounds_draws_and_contexts_as_the_command_line_does():
    """The API allocates a batch's draws at once too: refused when the settings are made, not at the first measure."""
    from hf_flatbias import HessianTraceCallback
    from hf_flatbias.flatness import TraceSettings

    with pytest.raises(ValueError, match="n_draws=1000000000 is more than 10,000"):
        TraceSettings(n_draws=10**9)
    for name, value in (("n_draws", 10**9), ("n_contexts", 10**9)):
        with pytest.raises(ValueError, match=f"{name}={value} is more than"):
            HessianTraceCallback(**{name: value})
    TraceSettings(n_draws=10_000)
    HessianTraceCallback(n_draws=10_000, n_contexts=1_000_000)
