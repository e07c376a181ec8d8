"""An output path that names an input (the same file, a link to it, a file of a folder that is read) is refused in
one line before anything is loaded, and the input is left as it was (issue 58: ``--output mydata.jsonl`` replaced
the data set it measured)."""

from __future__ import annotations

import json
import os

import pytest

from hf_flatbias.cli import main
from hf_flatbias.commands.paths import check_outputs_spare_inputs


@pytest.fixture
def data_and_model(tmp_path):
    data = tmp_path / "mydata.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [1, 2, 3, i]}) + "\n" for i in range(600)))
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")  # refused before it is read, so it need not be a real checkpoint
    return data, model


def _refused_untouched(arguments, capsys, files, *words):
    before = {path: path.read_bytes() for path in files}
    assert main(arguments) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    for word in words:
        assert word in error, error
    assert {path: path.read_bytes() for path in files} == before


@pytest.mark.parametrize("series", [False, True], ids=["one checkpoint", "series"])
def test_trace_output_that_is_its_data_is_refused_and_the_data_kept(data_and_model, tmp_path, capsys, series):
    data, model = data_and_model
    command = ["trace", "user/series", "--revisions", "step1,step2"] if series else ["trace", str(model)]
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)
    hard = tmp_path / "hard.jsonl"
    os.link(data, hard)
    for output in (data, link, hard, tmp_path / "." / "mydata.jsonl"):
        _refused_untouched(
            [*command, "--data", str(data), "--output", str(output)], capsys, [data], "--output", "--data",
            "pass another --output",
        )  # fmt: skip


def test_trace_output_or_plot_inside_the_model_folder_is_refused(data_and_model, tmp_path, capsys):
    data, model = data_and_model
    config = model / "config.json"
    for output in (config, model / "trace.json"):
        _refused_untouched(
            ["trace", str(model), "--data", str(data), "--output", str(output)], capsys, [config, data], "MODEL"
        )
    arguments = ["trace", str(model), "--data", str(data), "--output", str(tmp_path / "t.json")]
    _refused_untouched([*arguments, "--plot", str(model / "p.png")], capsys, [config], "--plot", "MODEL")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "vocab.txt").write_text("[PAD]\n")
    vocabulary = tokenizer / "vocab.txt"
    arguments = ["trace", str(model), "--data", str(data), "--tokenizer", str(tokenizer), "--output", str(vocabulary)]
    _refused_untouched(arguments, capsys, [vocabulary], "--tokenizer")


def test_trace_plot_on_its_own_output_is_refused(data_and_model, tmp_path, capsys):
    data, model = data_and_model
    same = tmp_path / "t.png"
    arguments = ["trace", str(model), "--data", str(data), "--output", str(same), "--plot", str(same)]
    _refused_untouched(arguments, capsys, [data], "--plot", "--output")


def test_glue_output_folder_that_holds_or_is_inside_the_model_is_refused(tmp_path, capsys):
    runs = tmp_path / "runs"
    model = runs / "sst2-full-seed42" / "checkpoint-500"  # where a run of this command would write its checkpoint
    model.mkdir(parents=True)
    config = model / "config.json"
    config.write_text("{}")
    for output in (runs, model, model / "glue"):
        _refused_untouched(
            ["glue", str(model), "--task", "sst2", "--output-dir", str(output)], capsys, [config], "--output-dir",
            "MODEL",
        )  # fmt: skip


def test_unrelated_paths_and_hub_ids_pass(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    model = tmp_path / "ckpt"
    model.mkdir()
    check_outputs_spare_inputs(
        {"--output": str(tmp_path / "out.json"), "--plot": str(tmp_path / "out.png"), "--unused": None},
        {"MODEL": str(model), "--data": str(data), "--tokenizer": "user/tokenizer", "--unused-input": None},
    )
    check_outputs_spare_inputs({"--output": str(tmp_path / "data.jsonl.out")}, {"--data": "user/dataset"})
    check_outputs_spare_inputs({"--output-dir": str(tmp_path / "glue")}, {"MODEL": str(model)}, folders=True)


@pytest.mark.parametrize(
    "content",
    ['{"note": "mine"}\n', "line one\nline two\n", json.dumps({"model": "m", "data": "d"}), ""],
    ids=["other json", "text", "some of the keys", "empty"],
)
def test_trace_output_that_is_not_a_trace_result_is_refused_and_kept(data_and_model, tmp_path, capsys, content):
    data, model = data_and_model
    notes = tmp_path / "notes.jsonl"
    notes.write_text(content)
    _refused_untouched(
        ["trace", str(model), "--data", str(data), "--output", str(notes)], capsys, [notes], "--output",
        "not an hf-flatbias trace result", "pass another --output",
    )  # fmt: skip


def test_trace_output_that_is_an_earlier_result_passes_the_check(tmp_path):
    from hf_flatbias.commands.paths import check_output_file, json_object_with
    from hf_flatbias.commands.trace import RESULT_KEYS

    earlier = tmp_path / "hessian_trace.json"
    earlier.write_text(json.dumps({"model": "m", "data": "d", "split": None, "seed": 0, "device": "cpu"}))
    own = json_object_with(*RESULT_KEYS)
    check_output_file(str(earlier), "--output", own=own, own_name="an hf-flatbias trace result")
    check_output_file(str(tmp_path / "new.json"), "--output", own=own, own_name="an hf-flatbias trace result")


@pytest.mark.parametrize("series", [False, True], ids=["one checkpoint", "series"])
def test_trace_plot_that_is_not_a_figure_is_refused_and_kept(data_and_model, tmp_path, capsys, series):
    data, model = data_and_model
    command = ["trace", "user/series", "--revisions", "step1,step2"] if series else ["trace", str(model)]
    photo = tmp_path / "holiday.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n a photograph, not a figure")
    _refused_untouched(
        [*command, "--data", str(data), "--output", str(tmp_path / "t.json"), "--plot", str(photo)], capsys, [photo],
        "--plot", "not a figure drawn by matplotlib", "pass another --plot",
    )  # fmt: skip


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_a_figure_matplotlib_drew_may_be_drawn_again(tmp_path, suffix):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hf_flatbias.commands.paths import FIGURE_OWNER, check_output_file, is_matplotlib_figure

    figure, axis = plt.subplots()
    axis.bar([0, 1], [1.0, 2.0])
    figure.savefig(tmp_path / f"groups{suffix}")
    plt.close(figure)
    check_output_file(str(tmp_path / f"groups{suffix}"), "--plot", own=is_matplotlib_figure, own_name=FIGURE_OWNER)


def test_demo_output_folder_of_the_users_own_is_refused_and_kept(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    notes = project / "notes.txt"
    notes.write_text("mine\n")
    _refused_untouched(
        ["demo", "--output-dir", str(project)], capsys, [notes], "--output-dir", "'notes.txt'", "new or empty"
    )
    assert sorted(path.name for path in project.iterdir()) == ["notes.txt"]


def test_demo_output_folder_holding_only_the_demos_files_passes_the_check(tmp_path):
    from hf_flatbias.commands.paths import check_output_folder, is_demo_entry

    for name in ("adamw", "sam"):
        (tmp_path / name).mkdir()
    for name in ("demo.json", "demo.png", "demo.json.123.partial"):
        (tmp_path / name).write_text("{}")
    check_output_folder(str(tmp_path), "--output-dir", own_entries=is_demo_entry, own_name="the demo")
    check_output_folder(str(tmp_path / "new"), "--output-dir", own_entries=is_demo_entry, own_name="the demo")


def test_glue_output_folder_of_the_users_own_is_refused_and_kept(tmp_path, capsys):
    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    runs = tmp_path / "runs"
    (runs / "sst2-full-seed0").mkdir(parents=True)  # an earlier run of this command may be written over
    notes = runs / "notes.txt"
    notes.write_text("mine\n")
    _refused_untouched(
        ["glue", str(model), "--task", "sst2", "--output-dir", str(runs)], capsys, [notes], "--output-dir",
        "'notes.txt'",
    )  # fmt: skip
    notes.unlink()
    from hf_flatbias.commands.paths import check_output_folder
    from hf_flatbias.glue.tasks import is_run_folder_name, run_folder_name

    check_output_folder(str(runs), "--output-dir", own_entries=is_run_folder_name, own_name="hf-flatbias glue")
    assert all(is_run_folder_name(run_folder_name("stsb", mode, 3)) for mode in ("full", "linear_cls", "pooler_head"))
    assert not any(is_run_folder_name(name) for name in ("notes.txt", "sst2-full", "sst2-other-seed1", "x-full-seed1"))
