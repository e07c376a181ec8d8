"""The GLUE comparison recipe: argument handling, checkpoint checks and outputs (fast); end to end (slow)."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_recipe_bookcorpus import run_bookcorpus_smoke
from transformers import BertConfig, BertForMaskedLM, BertModel

from hf_flatbias import glue
from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.recipe_args import parse_dataclass_args
from hf_flatbias.text_data import train_wordpiece_tokenizer
from hf_flatbias.trainer import FlatBiasTrainer

SENTENCES = ["the film was wonderful and moving", "a dull and tired story", "great acting, weak script"] * 5


def _config(vocab_size: int) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )


@pytest.fixture(scope="module")
def glue_compare(recipes):
    return recipes.load("glue_compare")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_wordpiece_tokenizer(
        SENTENCES, vocab_size=60, min_frequency=1, cache_dir=tmp_path_factory.mktemp("tokenizers")
    )


def test_leading_positionals_are_the_models(glue_compare):
    argv = ["ckpt/a", "org/b", "--tasks", "sst2,rte", "--smoke"]
    assert glue_compare.split_positional_models(argv) == [
        "--tasks",
        "sst2,rte",
        "--smoke",
        "--models",
        "ckpt/a",
        "org/b",
    ]
    assert glue_compare.split_positional_models(["--tasks", "rte"]) == ["--tasks", "rte"]


def test_bad_task_fails_before_any_model_is_loaded(glue_compare, tmp_path):
    with pytest.raises(ValueError, match="Unknown GLUE task 'sst5'"):
        glue_compare.main(["does/not/exist", "--tasks", "sst2,sst5", "--output_dir", str(tmp_path)])
    with pytest.raises(ValueError, match="at least one checkpoint"):
        glue_compare.main(["--tasks", "sst2", "--output_dir", str(tmp_path)])


def test_checkpoint_without_mlm_head_is_rejected(glue_compare, tmp_path, tokenizer):
    BertModel(_config(len(tokenizer)), add_pooling_layer=False).save_pretrained(tmp_path)  # encoder only
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no trained masked-LM head"):
        glue_compare.load_masked_lm(str(tmp_path))


def test_checkpoint_without_tokenizer_is_rejected(glue_compare, tmp_path, tokenizer):
    BertForMaskedLM(_config(len(tokenizer))).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only special tokens"):
        glue_compare.load_masked_lm(str(tmp_path))


def test_tokenizer_larger_than_the_embedding_is_rejected(glue_compare, tmp_path, tokenizer):
    BertForMaskedLM(_config(len(tokenizer) - 10)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="do not belong together"):
        glue_compare.load_masked_lm(str(tmp_path))


def _rows_and_pairs(glue_compare):
    rows, scores = [], {}
    for model, loss, trace, per_task in (
        ("runs/sam", 3.1, 40.0, {"sst2": [0.8, 0.9, 0.85], "rte": [0.6, 0.62, 0.61]}),
        ("runs/plain", 3.1, 90.0, {"sst2": [0.7, 0.72, 0.74], "rte": [0.5, 0.6, 0.55]}),
    ):
        for task, values in per_task.items():
            interval = glue.mean_interval(values)
            rows.append(
                {
                    "model": model,
                    "corpus": "bbc_news (held-out: 3000 texts, split seed 0)",
                    "pretrain_loss": loss,
                    "pretrain_loss_stderr": 0.004,
                    "trace": trace,
                    "trace_stderr": 1.5,
                    "released_trace": -12.0,
                    "released_trace_stderr": 3.0,
                    "task": task,
                    "mode": "full",
                    "metric": "accuracy",
                    "mean": interval.estimate,
                    "ci_low": interval.low,
                    "ci_high": interval.high,
                    "std": float(np.std(values, ddof=1)),
                    "scores": values,
                }
            )
            scores[(model, task)] = values
    sums = torch.tensor([10.0, 12.0, 11.0, 9.0], dtype=torch.float64)
    losses = {"runs/sam": (sums, torch.full((4,), 3.0)), "runs/plain": (sums + 0.01, torch.full((4,), 3.0))}
    corpora = {"runs/sam": "bbc", "runs/plain": "bbc"}
    pairs = glue_compare.pairwise_comparisons(["runs/sam", "runs/plain"], ["sst2", "rte"], losses, scores, corpora)
    return rows, pairs


def test_pairwise_comparisons_mark_same_and_different_losses(glue_compare):
    _, pairs = _rows_and_pairs(glue_compare)
    (pair,) = pairs
    assert pair["loss_difference"] == pytest.approx(-0.01 / 3)  # identical per-block gaps: zero paired error
    assert pair["loss_difference_stderr"] == pytest.approx(0.0, abs=1e-12) and pair["same_loss"] is False
    expected = glue.paired_difference([0.8, 0.9, 0.85], [0.7, 0.72, 0.74])
    assert (pair["sst2"]["difference"], pair["sst2"]["ci_low"]) == pytest.approx((expected.estimate, expected.low))

    noisy = {"a": (torch.tensor([10.0, 12.0, 11.0], dtype=torch.float64), torch.full((3,), 3.0))}
    noisy["b"] = (torch.tensor([10.3, 11.7, 11.0], dtype=torch.float64), torch.full((3,), 3.0))
    scores = {("a", "rte"): [0.5, 0.6], ("b", "rte"): [0.5, 0.7]}
    (same,) = glue_compare.pairwise_comparisons(["a", "b"], ["rte"], noisy, scores, {"a": "x", "b": "x"})
    assert same["loss_difference"] == pytest.approx(0.0, abs=1e-12) and same["same_loss"] is True
    (apart,) = glue_compare.pairwise_comparisons(["a", "b"], ["rte"], noisy, scores, {"a": "x", "b": "y"})
    assert apart["loss_difference"] is None and apart["same_loss"] is None  # different held-out text: not paired


def test_outputs_hold_every_number(glue_compare, tmp_path):
    rows, pairs = _rows_and_pairs(glue_compare)
    paths = glue_compare.write_outputs(rows, ["sst2", "rte"], tmp_path, standin_tasks=["sst2"], pairs=pairs)
    assert paths["plot"].stat().st_size > 10_000  # a rendered figure, not an empty file

    table = paths["markdown"].read_text().splitlines()
    assert table[0] == (
        "| checkpoint | held-out loss ± s.e. | Tr(F) ± s.e. | released-code Tr(H) ± s.e. | sst2* (accuracy) "
        "| rte (accuracy) | average |"
    )
    assert table[-1].startswith("* Offline stand-in, not GLUE")
    sam = next(line for line in table if line.startswith("| `runs/sam`"))
    low, high = glue.mean_interval([0.8, 0.9, 0.85]).low, glue.mean_interval([0.8, 0.9, 0.85]).high
    assert f"| 85.00 [{100 * low:.2f}, {100 * high:.2f}] |" in sam
    assert "| 3.1000 ± 0.0040 | 40 ± 1.5 | -12 ± 3 |" in sam and sam.endswith("| 73.00 |")
    pair_line = next(line for line in table if line.startswith("| `runs/sam` | `runs/plain`"))
    assert "-0.0033 ± 0.0000 | **no** |" in pair_line

    with paths["csv"].open() as handle:
        written = list(csv.DictReader(handle))
    assert [(r["model"], r["task"]) for r in written] == [(r["model"], r["task"]) for r in rows]
    assert written[1]["scores"] == "0.6 0.62 0.61" and float(written[3]["trace"]) == 90.0
    assert float(written[0]["ci_low"]) == pytest.approx(low)
    with paths["paired_csv"].open() as handle:
        paired = list(csv.DictReader(handle))
    assert [r["quantity"] for r in paired] == ["pretrain_loss", "sst2", "rte"]
    assert float(paired[1]["difference"]) == pytest.approx(pairs[0]["sst2"]["difference"])


def test_a_hutchinson_trace_is_labelled_the_hessian_trace(glue_compare, tmp_path):
    rows, pairs = _rows_and_pairs(glue_compare)
    paths = glue_compare.write_outputs(rows, ["sst2", "rte"], tmp_path, pairs=pairs, trace_estimator="hutchinson")
    table = paths["markdown"].read_text()
    assert table.startswith("| checkpoint | held-out loss ± s.e. | Tr(H) ± s.e. |")
    assert "Tr(F)" not in table  # a Hutchinson estimate is not the Fisher trace


def test_the_corpus_recorded_in_a_card_is_the_one_measured_on(glue_compare, recipes, tmp_path):
    from hf_flatbias.modelcard import FlatnessCard

    bert_bookcorpus = recipes.load("bert_bookcorpus")
    DataArguments, corpus_record = bert_bookcorpus.DataArguments, bert_bookcorpus.corpus_record
    load_text = bert_bookcorpus.load_text
    data = DataArguments(dataset="bbc_news", validation_texts=50)
    pretraining_split = load_text(data)["validation"]
    FlatnessCard(model_name="ckpt", pretraining_corpus=corpus_record(data)).save(tmp_path)

    corpus = glue_compare.held_out_corpus(str(tmp_path))
    assert corpus.to_record() == {"dataset": "bbc_news", "text_column": "text", "validation_texts": 50, "split_seed": 0}
    assert corpus.held_out()["text"] == pretraining_split["text"]  # the very texts held out from pre-training
    assert corpus.held_out(max_texts=7)["text"] == pretraining_split["text"][:7]
    train = set(load_text(DataArguments(dataset="bbc_news", validation_texts=50))["train"]["text"])
    assert not train & set(pretraining_split["text"])


def test_unknown_corpus_without_text_dataset_is_refused_before_any_compute(glue_compare, tmp_path, tokenizer):
    BertForMaskedLM(_config(len(tokenizer))).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not record its pre-training corpus.*--text_dataset"):
        glue_compare.main([str(tmp_path), "--tasks", "sst2", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_offline_tasks_without_data_are_skipped_with_one_line(glue_compare, monkeypatch, capsys):
    monkeypatch.setattr(glue.data, "hub_is_reachable", lambda: False)
    found = glue_compare.load_task_data(["sst2", "rte"], None)
    assert list(found) == ["sst2"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Skipping rte: no data")
    with pytest.raises(ValueError, match="None of the tasks"):
        glue_compare.load_task_data(["rte"], None)


@pytest.mark.slow  # a whole recipe's smoke run (minutes on CI's 2 cores); its parts are tested by the fast tests
def test_glue_compare_smoke_on_checkpoints_saved_by_the_recipe(recipes, tmp_path):
    checkpoints = []
    for setting in ("adamw_dropout_wd", "no_dropout_no_wd_sam"):
        run_bookcorpus_smoke(recipes, tmp_path, setting, tmp_path / setting)
        checkpoints.append(str(tmp_path / setting))
    output = tmp_path / "compare"
    arguments = [*checkpoints, "--smoke", "--output_dir", str(output)]
    completed = recipes.run("glue_compare.py", *arguments, tmp_path=tmp_path, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]

    with (output / "glue_compare.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(Path(r["model"]).name, r["task"]) for r in rows] == [
        ("adamw_dropout_wd", "sst2"),
        ("no_dropout_no_wd_sam", "sst2"),
    ]
    for row in rows:
        assert 0.0 <= float(row["mean"]) <= 1.0 and len(row["scores"].split()) == 2
        assert float(row["trace"]) > 0 and 0 < float(row["pretrain_loss"]) < 9
        assert 0 < float(row["pretrain_loss_stderr"]) < 0.5 and float(row["released_trace_stderr"]) > 0
        # the corpus each checkpoint's card recorded, not a default
        assert row["corpus"] == "bbc_news (held-out: 200 texts, split seed 0)"
    assert len(list(csv.DictReader((output / "glue_compare_paired.csv").open()))) == 2  # loss and sst2
    assert (output / "glue_compare.png").stat().st_size > 10_000
    assert "adamw_dropout_wd" in (output / "glue_compare.md").read_text()
    assert torch.isfinite(torch.tensor([float(r["trace_stderr"]) for r in rows])).all()


def test_standin_scores_never_go_into_a_card(glue_compare, tmp_path):
    with pytest.raises(ValueError, match="stand-in scores as GLUE SST-2"):
        glue_compare.main(["some/model", "--tasks", "sst2", "--update_cards", "--output_dir", str(tmp_path)])


def test_shipped_config_parses(glue_compare, recipes, tmp_path):
    argv = glue_compare.split_positional_models(
        ["runs/a", "runs/b", "--config", str(recipes.directory / "configs" / "glue_compare.yaml")]
    )
    args, _, training = parse_dataclass_args(glue_compare.ARGUMENT_TYPES, argv)
    assert args.models == ["runs/a", "runs/b"] and args.seeds == [0, 1, 2, 3, 4] and args.tasks == "sst2,qnli,rte"
    assert training.learning_rate == 2e-5 and training.num_train_epochs == 3


@pytest.mark.slow  # a whole recipe's smoke run (minutes on CI's 2 cores); its parts are tested by the fast tests
def test_gpu_script_smoke_runs_the_whole_pipeline_on_cpu(recipes, tmp_path):
    output = tmp_path / "glue_gpu"
    command = ["bash", str(recipes.directory / "glue_gpu.sh"), "--smoke", str(output)]
    completed = subprocess.run(
        command, env=recipes.environment(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    assert "Skipping rte: no data" in completed.stderr  # offline: one line, not a failure
    table = (output / "compare" / "glue_compare.md").read_text()
    for setting in ("adamw_dropout_wd", "no_dropout_no_wd", "no_dropout_no_wd_sam"):
        assert f"{setting}`" in table
        assert "roberta-prelayernorm" in (output / setting / "config.json").read_text()  # the pre-LN model
    with (output / "compare" / "glue_compare_paired.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3 * 2  # three pairs: loss and sst2 each


def test_checkpoints_of_different_vocabularies_are_refused_before_any_compute(glue_compare, tmp_path, tokenizer):
    other = train_wordpiece_tokenizer(
        ["completely different words here", "nothing alike at all"] * 5,
        vocab_size=50,
        min_frequency=1,
        cache_dir=tmp_path / "other_tokenizers",
    )
    for name, vocabulary in (("a", tokenizer), ("b", other)):
        BertForMaskedLM(_config(len(vocabulary))).save_pretrained(tmp_path / name)
        vocabulary.save_pretrained(tmp_path / name)
    argv = [str(tmp_path / "a"), str(tmp_path / "b"), "--tasks", "sst2", "--text_dataset", "bbc_news"]
    with pytest.raises(ValueError, match="another vocabulary"):
        glue_compare.main([*argv, "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


class _OptimizerBuilt(Exception):
    """Stops a run once its optimizer exists: the learning rate it holds is all these tests need."""


@pytest.fixture
def optimizer_learning_rates(monkeypatch):
    """The learning rates in the param groups of each optimizer a FlatBiasTrainer builds (before any scheduler)."""
    seen = []
    build = FlatBiasTrainer.create_optimizer

    def record(self, *args, **kwargs):
        optimizer = build(self, *args, **kwargs)
        seen.append({group["lr"] for group in optimizer.param_groups})
        raise _OptimizerBuilt

    monkeypatch.setattr(FlatBiasTrainer, "create_optimizer", record)
    return seen


@pytest.fixture(scope="module")
def english_checkpoint(tmp_path_factory, tokenizer):
    """A masked-LM checkpoint, its held-out text and SST-2-shaped files, all in the tokenizer's vocabulary."""
    folder = tmp_path_factory.mktemp("lr_checkpoint")
    torch.manual_seed(0)
    BertForMaskedLM(_config(len(tokenizer))).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "held_out.txt").write_text("\n".join(SENTENCES * 4) + "\n")
    rows = "sentence,label\n" + "".join(f'"{s}",{int("great" in s or "wonderful" in s)}\n' for s in SENTENCES)
    (folder / "sst2").mkdir()
    (folder / "sst2" / "train.csv").write_text(rows)
    (folder / "sst2" / "validation.csv").write_text(rows)
    return folder


EXPECTED_LEARNING_RATES = {"full": 2e-5, "linear_cls": 1e-3, "linear_tokens": 1e-3, "pooler_head": 1e-3}


@pytest.mark.parametrize("mode", list(EXPECTED_LEARNING_RATES))
@pytest.mark.parametrize("given", [None, 5e-5])  # 5e-5: TrainingArguments' default, given on purpose
def test_the_learning_rate_reaching_the_optimizer_in_glue_compare(
    glue_compare, english_checkpoint, optimizer_learning_rates, tmp_path, mode, given
):
    argv = [
        str(english_checkpoint / "model"), "--tasks", "sst2", "--mode", mode, "--seeds", "0",
        "--data_dir", str(english_checkpoint), "--text_dataset", str(english_checkpoint / "held_out.txt"),
        "--loss_maskings", "1", "--max_seq_length", "16", "--trace_contexts", "2", "--released_trace_batches", "0",
        "--probe_positions", "3", "--max_steps", "1", "--use_cpu", "--output_dir", str(tmp_path),
    ]  # fmt: skip
    if given is not None:
        argv += ["--learning_rate", str(given)]
    with pytest.raises(_OptimizerBuilt):
        glue_compare.main(argv)
    assert optimizer_learning_rates == [{EXPECTED_LEARNING_RATES[mode] if given is None else given}]


@pytest.mark.parametrize("mode", list(EXPECTED_LEARNING_RATES))
def test_the_learning_rate_reaching_the_optimizer_in_finetune_glue(
    english_checkpoint, optimizer_learning_rates, tmp_path, mode
):
    data = glue.load_glue_dataset("sst2", data_dir=english_checkpoint)
    model = str(english_checkpoint / "model")
    arguments = glue.GlueArguments(mode=mode, seeds=[0], probe_positions=3)
    with pytest.raises(_OptimizerBuilt):
        glue.finetune_glue(model, "sst2", arguments, glue.GlueConfig(max_steps=1, use_cpu=True), dataset=data)
    assert optimizer_learning_rates == [{EXPECTED_LEARNING_RATES[mode]}]
    with pytest.raises(TypeError, match="GlueConfig"):  # a plain config would bring TrainingArguments' 5e-5
        glue.finetune_glue(model, "sst2", arguments, FlatBiasConfig(use_cpu=True), dataset=data)
