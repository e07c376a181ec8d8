"""``hf-flatbias trace``: a saved checkpoint and a text file in, the estimate printed and written as JSON."""

import json

import pytest
import torch
from transformers import BertForMaskedLM, BertModel

from hf_flatbias.cli import main
from hf_flatbias.flatness import estimate_hessian_trace
from hf_flatbias.synthetic import make_tokenizer
from tests.helpers.tiny_models import small_bert_config, trace_command_contexts

WORDS = [f"w{i}" for i in range(10)]


def _config(tokenizer):
    # 32 positions: the tokenizer's model_max_length
    return small_bert_config(len(tokenizer), max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tokenizer = make_tokenizer(WORDS, model_max_length=32)
    torch.manual_seed(0)
    BertForMaskedLM(_config(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, 10, (7,), generator=generator)) for _ in range(8)]
    data = folder / "text.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return folder, data, tokenizer, lines


def test_trace_command_prints_and_writes_the_library_estimate(checkpoint, tmp_path, capsys):
    folder, data, tokenizer, lines = checkpoint
    output = tmp_path / "out" / "trace.json"
    code = main(
        [
            "trace",
            str(folder),
            "--data",
            str(data),
            "--n-contexts",
            "6",
            "--n-draws",
            "3",
            "--seed",
            "4",
            "--output",
            str(output),
        ]
    )
    assert code == 0
    written = json.loads(output.read_text())
    assert written["model"] == str(folder)
    estimate = written["estimate"]
    assert estimate["n_contexts"] == 6 and estimate["n_draws"] == 3 and estimate["estimator"] == "per_sample"
    printed = capsys.readouterr()
    assert "Fisher trace Tr(F) of" in printed.out  # what the per_sample estimator measures
    assert "Tr(F) (per_sample)" in printed.err and "6/6" in printed.err  # the progress bar, on stderr

    # the same measurement through the library, contexts built independently of the command
    contexts = trace_command_contexts(tokenizer, lines, n_contexts=6, seed=4)
    expected = estimate_hessian_trace(BertForMaskedLM.from_pretrained(folder), contexts, n_draws=3, seed=4)
    assert estimate["mean"] == pytest.approx(expected.mean, rel=1e-6)
    assert estimate["stderr"] == pytest.approx(expected.stderr, rel=1e-6)


def test_trace_command_writes_its_result_whole_or_not_at_all_and_over_its_own_earlier_result(
    checkpoint, tmp_path, monkeypatch, capsys
):
    folder, data, _, _ = checkpoint
    output = tmp_path / "trace.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "2", "--n-draws", "1", "--no-progress"]
    assert main([*arguments, "--output", str(output)]) == 0  # a new file
    earlier = output.read_bytes()

    def killed_before_the_rename(*_):
        raise OSError("killed")

    monkeypatch.setattr("hf_flatbias.results.os.replace", killed_before_the_rename)
    assert main([*arguments, "--seed", "1", "--output", str(output)]) == 2
    assert output.read_bytes() == earlier  # the earlier result, still whole
    monkeypatch.undo()
    assert main([*arguments, "--seed", "1", "--output", str(output)]) == 0  # its own earlier result is written over
    assert json.loads(output.read_text())["seed"] == 1
    capsys.readouterr()


def test_trace_command_progress_bar_can_be_turned_off(checkpoint, tmp_path, capsys):
    folder, data, _, _ = checkpoint
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "2", "--n-draws", "1", "--no-progress"]
    assert main([*arguments, "--output", str(tmp_path / "trace.json")]) == 0
    assert "Hessian trace" not in capsys.readouterr().err  # stderr still holds the loading bars of transformers


def test_trace_command_accepts_ready_made_contexts(checkpoint, tmp_path):
    folder, _, tokenizer, _ = checkpoint
    contexts = [{"input_ids": [2, 7, 4, 9, 3], "attention_mask": [1] * 5, "labels": [-100, -100, 8, -100, -100]}] * 3
    data = tmp_path / "contexts.json"
    data.write_text("\n".join(json.dumps(c) for c in contexts))
    output = tmp_path / "t.json"
    assert (
        main(
            [
                "trace",
                str(folder),
                "--data",
                str(data),
                "--n-draws",
                "2",
                "--estimator",
                "naive",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    assert json.loads(output.read_text())["estimate"]["n_contexts"] == 3


def test_trace_command_rejects_bad_input(checkpoint, tmp_path, capsys):
    folder, data, tokenizer, _ = checkpoint
    headless = tmp_path / "headless"
    BertModel(_config(tokenizer)).save_pretrained(headless)
    assert main(["trace", str(headless), "--data", str(data), "--output", str(tmp_path / "x.json")]) == 2
    assert "without a language-model head" in capsys.readouterr().err

    assert main(["trace", str(folder), "--data", str(data), "--n-draws", "0"]) == 2
    assert "--n-draws must be >= 1" in capsys.readouterr().err

    other = tmp_path / "other"
    BertForMaskedLM(_config(tokenizer)).save_pretrained(other)
    make_tokenizer([f"v{i}" for i in range(40)]).save_pretrained(other)
    assert main(["trace", str(other), "--data", str(data), "--output", str(tmp_path / "y.json")]) == 2
    assert "do not belong together" in capsys.readouterr().err

    assert main(["trace", str(folder), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    error = captured.err.strip().splitlines()[-1]  # after any progress bar of the data loading
    assert error.startswith("hf-flatbias trace: error: ")
    return error


def test_english_text_on_a_model_of_another_vocabulary_says_the_tokenizer_does_not_fit(checkpoint, tmp_path, capsys):
    folder, *_ = checkpoint
    english = tmp_path / "english.txt"
    english.write_text("The quick brown fox jumps over the lazy dog.\nIt rained all day in the city.\n")
    error = _one_line_error(capsys, ["trace", str(folder), "--data", str(english), "--n-contexts", "4"])
    assert "does not fit" in error and "100% of its tokens are unknown" in error


@pytest.mark.parametrize(("name", "content"), [("empty.txt", ""), ("blank.jsonl", "\n\n"), ("broken.jsonl", '{"te')])
def test_an_empty_or_unreadable_data_file_is_one_line_naming_it(checkpoint, tmp_path, capsys, name, content):
    folder, *_ = checkpoint
    data = tmp_path / name
    data.write_text(content)
    error = _one_line_error(capsys, ["trace", str(folder), "--data", str(data)])
    # a .jsonl's first lines are read before datasets: the broken one is named by its line
    assert str(data) in error and any(words in error for words in ("is empty", "could not be read", ":1 is not a JSON"))
    assert data.read_text() == content


def test_a_config_json_that_is_not_json_is_one_line_naming_it(checkpoint, tmp_path, capsys):
    folder, data, *_ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        if path.is_file():
            (broken / path.name).write_bytes(path.read_bytes())
    (broken / "config.json").write_text("{not json")
    error = _one_line_error(capsys, ["trace", str(broken), "--data", str(data)])
    assert str(broken / "config.json") in error and "not a valid JSON" in error


def test_trace_command_prints_the_split_by_group_and_plots_it(checkpoint, tmp_path, capsys):
    folder, data, _, _ = checkpoint
    output, plot = tmp_path / "trace.json", tmp_path / "plots" / "groups.png"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "6", "--seed", "4", "--no-progress"]
    assert main([*arguments, "--batch-size", "auto", "--output", str(output), "--plot", str(plot)]) == 0
    estimate = json.loads(output.read_text())["estimate"]
    groups = ["embeddings", "block.0", "head", "output_layer"]
    assert list(estimate["by_group"]) == groups
    assert sum(part["mean"] for part in estimate["by_group"].values()) == pytest.approx(estimate["mean"], rel=1e-12)
    printed = capsys.readouterr().out.splitlines()
    table = printed[printed.index(next(line for line in printed if line.startswith("group"))) :][: len(groups) + 2]
    assert [line.split()[0] for line in table] == ["group", *groups, "total"]
    assert float(table[1].split()[1]) == pytest.approx(estimate["by_group"]["embeddings"]["mean"], rel=1e-5)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the split does not change the total: the same estimate without it
    assert main([*arguments, "--no-by-group", "--output", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())["estimate"]
    assert plain["by_group"] is None and plain["mean"] == pytest.approx(estimate["mean"], rel=1e-12)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--plot", "groups.txt"], "use a file ending in one of"),
        (["--estimator", "summed", "--plot", "groups.png"], "need a per-context estimator"),
        (["--no-by-group", "--plot", "groups.png"], "drop --no-by-group"),
    ],
)
def test_trace_command_refuses_bad_group_options_before_loading(checkpoint, tmp_path, capsys, extra, message):
    folder, data, _, _ = checkpoint
    assert main(["trace", str(folder), "--data", str(data), "--output", str(tmp_path / "t.json"), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_trace_command_batch_size_is_a_positive_integer_or_auto(checkpoint, capsys):
    folder, data, _, _ = checkpoint
    with pytest.raises(SystemExit) as exited:
        main(["trace", str(folder), "--data", str(data), "--batch-size", "0"])
    assert exited.value.code == 2
    assert "expected a positive integer or 'auto', got '0'" in capsys.readouterr().err
