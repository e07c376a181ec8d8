"""The GLUE comparison recipe: argument handling, checkpoint checks and outputs (fast); end to end (slow)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from test_recipe_bookcorpus import run_bookcorpus_smoke
from transformers import BertConfig, BertForMaskedLM, BertModel

from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.experiments import parse_dataclass_args
from hf_flatbias.text_data import train_wordpiece_tokenizer

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


def test_outputs_hold_every_number(glue_compare, tmp_path):
    rows = []
    for model, loss, trace, scores in (
        ("runs/sam", 3.1, 40.0, {"sst2": [0.8, 0.9], "rte": [0.6, 0.62]}),
        ("runs/plain", 3.1, 90.0, {"sst2": [0.7, 0.72], "rte": [0.5, 0.6]}),
    ):
        for task, values in scores.items():
            rows.append(
                {
                    "model": model,
                    "pretrain_loss": loss,
                    "trace": trace,
                    "trace_stderr": 1.5,
                    "task": task,
                    "mode": "full",
                    "metric": "accuracy",
                    "mean": sum(values) / 2,
                    "std": abs(values[0] - values[1]) / 2**0.5,
                    "scores": values,
                }
            )
    paths = glue_compare.write_outputs(rows, ["sst2", "rte"], tmp_path, standin_tasks=["sst2"])
    assert paths["plot"].stat().st_size > 10_000  # a rendered figure, not an empty file

    table = paths["markdown"].read_text().splitlines()
    assert table[0] == "| checkpoint | pre-training loss | Tr(H) ± s.e. | sst2* (accuracy) | rte (accuracy) | average |"
    assert table[-1].startswith("* Offline stand-in, not GLUE")
    sam = next(line for line in table if "runs/sam" in line)
    # sst2 mean 85.00, std 7.07; rte 61.00 ± 1.41; average of the task means 73.00
    assert "| 85.00 ± 7.07 | 61.00 ± 1.41 | 73.00 |" in sam
    assert "| 40 ± 1.5 |" in sam

    with paths["csv"].open() as handle:
        written = list(csv.DictReader(handle))
    assert [(r["model"], r["task"]) for r in written] == [(r["model"], r["task"]) for r in rows]
    assert written[1]["scores"] == "0.6 0.62" and float(written[3]["trace"]) == 90.0


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
    args, training = parse_dataclass_args((glue_compare.CompareArguments, FlatBiasConfig), argv)
    assert args.models == ["runs/a", "runs/b"] and args.seeds == [0, 1, 2] and args.tasks == "sst2,qnli,rte"
    assert training.learning_rate == 2e-5 and training.num_train_epochs == 3
