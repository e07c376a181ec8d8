"""The BookCorpus recipe: its configs and masked-LM data helpers (fast), and a smoke run end to end (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import BertConfig, BertForMaskedLM

from hf_flatbias import text_data
from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.recipe_args import parse_dataclass_args
from hf_flatbias.text_data import (
    mask_blocks_once,
    masked_lm_loss,
    tokenize_into_blocks,
    train_wordpiece_tokenizer,
)

CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"

TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "a dog ran across the park after a red ball",
    "markets rose today as the bank cut interest rates",
    "the minister said the new law would help schools",
] * 6


@pytest.fixture(scope="module")
def bert_bookcorpus(recipes):
    return recipes.load("bert_bookcorpus")


@pytest.fixture(scope="module")
def argument_types(bert_bookcorpus):
    """The recipe's argument dataclasses, in its order."""
    return (
        bert_bookcorpus.ModelArguments,
        bert_bookcorpus.DataArguments,
        bert_bookcorpus.TraceArguments,
        FlatBiasConfig,
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_wordpiece_tokenizer(
        TEXTS, vocab_size=90, min_frequency=1, cache_dir=tmp_path_factory.mktemp("tokenizers")
    )


@pytest.mark.parametrize(
    ("setting", "dropout", "weight_decay", "method"),
    [
        ("adamw_dropout_wd", 0.1, 0.01, "none"),
        ("no_dropout_no_wd", 0.0, 0.0, "none"),
        ("no_dropout_no_wd_sam", 0.0, 0.0, "sam"),
    ],
)
def test_the_three_paper_settings_parse(argument_types, setting, dropout, weight_decay, method, tmp_path):
    config = CONFIGS / f"{setting}.yaml"
    model, data, flatness, training = parse_dataclass_args(
        argument_types, ["--config", str(config), "--output_dir", str(tmp_path)]
    )
    assert (model.dropout, training.weight_decay, training.flatness_method) == (dropout, weight_decay, method)
    assert training.output_dir == str(tmp_path)  # the command line wins over the YAML
    assert data.dataset == "auto" and flatness.trace_contexts > 0


def test_released_code_config_parses_to_its_settings(argument_types, bert_bookcorpus, tmp_path):
    model, data, _, training = parse_dataclass_args(
        argument_types, ["--config", str(CONFIGS / "released_code.yaml"), "--output_dir", str(tmp_path)]
    )
    assert model.architecture == "roberta-prelayernorm" and model.half_precision == "auto"
    assert model.tokenizer_name_or_path == bert_bookcorpus.BERT_UNCASED_IF_AVAILABLE
    assert (training.adam_epsilon, training.adam_beta2, training.warmup_steps) == (1e-6, 0.98, 0.133)
    assert training.max_grad_norm == 0 and not training.fp16  # fp16 is switched on only when a GPU is present
    assert data.mlm_probability == 0.15


def test_pre_ln_model_is_built_for_the_bert_tokenizer(bert_bookcorpus, tokenizer):
    model_args = bert_bookcorpus.ModelArguments(model_size="nano", architecture="roberta-prelayernorm")
    model = bert_bookcorpus.build_model(model_args, tokenizer)
    assert type(model).__name__ == "RobertaPreLayerNormForMaskedLM" and model.config.vocab_size == len(tokenizer)
    encoded = tokenizer(["the cat sat"], ["a dog ran"], return_tensors="pt")  # token type 1 on the second sentence
    assert model(**encoded).logits.shape[-1] == len(tokenizer)


def test_smoke_preset_sits_between_yaml_and_command_line(argument_types, bert_bookcorpus, tmp_path):
    config = CONFIGS / "no_dropout_no_wd_sam.yaml"
    model, data, flatness, training = parse_dataclass_args(
        argument_types,
        ["--config", str(config), "--smoke", "--max_steps", "7", "--output_dir", str(tmp_path)],
        smoke_settings=bert_bookcorpus.SMOKE_SETTINGS,
    )
    assert flatness.smoke and model.model_size == "nano" and data.dataset == "bbc_news"
    assert training.max_steps == 7  # command line over smoke
    assert training.flatness_method == "sam"  # YAML kept where smoke is silent


def test_smoke_run_gets_its_own_folder_beside_the_configs(argument_types, bert_bookcorpus, tmp_path):
    config = tmp_path / "setting.yaml"
    config.write_text((CONFIGS / "no_dropout_no_wd_sam.yaml").read_text().replace("runs/", f"{tmp_path}/runs/"))
    *_, real = parse_dataclass_args(argument_types, ["--config", str(config)])
    *_, smoke = parse_dataclass_args(
        argument_types, ["--config", str(config), "--smoke"], smoke_settings=bert_bookcorpus.SMOKE_SETTINGS
    )
    assert smoke.output_dir == f"{real.output_dir}-smoke"
    assert real.output_dir.startswith(str(tmp_path))


def test_unknown_yaml_key_and_missing_file_are_errors(argument_types, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 0.1\n")
    with pytest.raises(ValueError, match="learning_rat"):
        parse_dataclass_args(argument_types, ["--config", str(bad)])
    with pytest.raises(ValueError, match="no such file"):
        parse_dataclass_args(argument_types, ["--config", str(tmp_path / "missing.yaml")])


def test_offline_text_is_real_english():
    paragraphs = text_data.bbc_news_paragraphs()
    assert len(paragraphs) > 10_000
    assert sum(map(len, paragraphs)) > 4_000_000
    assert any("government" in p for p in paragraphs[:2000])


def test_tokenizer_is_cached_by_text_and_options(tmp_path):
    first = train_wordpiece_tokenizer(TEXTS, vocab_size=70, min_frequency=1, cache_dir=tmp_path)
    again = train_wordpiece_tokenizer(TEXTS, vocab_size=70, min_frequency=1, cache_dir=tmp_path)
    other = train_wordpiece_tokenizer(TEXTS[:4], vocab_size=60, min_frequency=1, cache_dir=tmp_path)
    assert first.get_vocab() == again.get_vocab()
    assert len([p for p in tmp_path.iterdir() if not p.name.startswith(".")]) == 2
    assert len(other) <= 60
    assert first.convert_ids_to_tokens(list(range(5))) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_blocks_are_the_concatenated_stream(tokenizer):
    blocks = tokenize_into_blocks(Dataset.from_dict({"text": TEXTS}), tokenizer, block_size=10)
    stream = [t for text in TEXTS for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    expected = [stream[i : i + 8] for i in range(0, len(stream) - 7, 8)]
    assert [row[1:-1] for row in blocks["input_ids"]] == expected
    assert {row[0] for row in blocks["input_ids"]} == {tokenizer.cls_token_id}
    assert {row[-1] for row in blocks["input_ids"]} == {tokenizer.sep_token_id}
    with pytest.raises(ValueError, match="text_column"):
        tokenize_into_blocks(Dataset.from_dict({"body": TEXTS}), tokenizer, block_size=10)


def test_fixed_masking_follows_bert_rules(tokenizer):
    blocks = tokenize_into_blocks(Dataset.from_dict({"text": TEXTS * 20}), tokenizer, block_size=32)
    masked = mask_blocks_once(blocks, tokenizer, mlm_probability=0.15, seed=3)
    assert masked["input_ids"] == mask_blocks_once(blocks, tokenizer, mlm_probability=0.15, seed=3)["input_ids"]
    original = torch.tensor(blocks["input_ids"])
    inputs, labels = torch.tensor(masked["input_ids"]), torch.tensor(masked["labels"])
    chosen = labels != -100
    assert torch.equal(labels[chosen], original[chosen])
    assert not chosen[:, 0].any() and not chosen[:, -1].any()  # [CLS]/[SEP] are never targets
    assert torch.equal(inputs[~chosen], original[~chosen])
    fraction = chosen.float().sum() / (original.numel() - 2 * len(original))
    assert 0.12 < fraction < 0.18
    share_masked = (inputs[chosen] == tokenizer.mask_token_id).float().mean()
    assert 0.7 < share_masked < 0.9


def test_masked_lm_loss_averages_over_tokens(tokenizer):
    blocks = tokenize_into_blocks(Dataset.from_dict({"text": TEXTS}), tokenizer, block_size=16)
    rows = mask_blocks_once(blocks, tokenizer, mlm_probability=0.3)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = BertForMaskedLM(config).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in rows:  # one row at a time: the reference cannot share a batching bug with the code
            log_probs = model(input_ids=torch.tensor([row["input_ids"]])).logits[0].log_softmax(-1)
            for position, label in enumerate(row["labels"]):
                if label != -100:
                    nll -= log_probs[position, label].item()
                    count += 1
    assert masked_lm_loss(model, rows, batch_size=3) == pytest.approx(nll / count, rel=1e-5)


def test_loss_standard_error_matches_a_direct_bootstrap_over_blocks():
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(5, 25, (400,), generator=generator).double()  # masked tokens per block vary
    block_difficulty = torch.randn(400, generator=generator, dtype=torch.float64)  # tokens of a block are correlated
    sums = counts * (3.0 + block_difficulty) + counts.sqrt() * torch.randn(
        400, generator=generator, dtype=torch.float64
    )
    mean, stderr = text_data.ratio_mean_stderr(sums, counts)
    assert mean == pytest.approx(float(sums.sum() / counts.sum()))

    resampled = torch.randint(0, 400, (4000, 400), generator=generator)
    bootstrap = sums[resampled].sum(dim=1) / counts[resampled].sum(dim=1)
    assert stderr == pytest.approx(float(bootstrap.std()), rel=0.06)
    # Treating tokens as independent would understate it badly: the blocks are the sampling units.
    assert stderr > 3 * float(block_difficulty.std()) / float(counts.sum()) ** 0.5


def test_row_losses_sum_to_the_mean_loss(tokenizer):
    blocks = tokenize_into_blocks(Dataset.from_dict({"text": TEXTS}), tokenizer, block_size=16)
    rows = mask_blocks_once(blocks, tokenizer, mlm_probability=0.3)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    model = BertForMaskedLM(config)
    sums, counts = text_data.masked_lm_row_losses(model, rows, batch_size=4)
    assert counts.tolist() == [sum(label != -100 for label in row["labels"]) for row in rows]
    assert float(sums.sum() / counts.sum()) == pytest.approx(masked_lm_loss(model, rows, batch_size=5), rel=1e-9)


def run_bookcorpus_smoke(recipes, tmp_path: Path, setting: str, output_dir: Path, *extra: str) -> dict:
    """Run the recipe as users do (a fresh process) and return its summary."""
    arguments = ["--config", str(CONFIGS / f"{setting}.yaml"), "--smoke", "--output_dir", str(output_dir), *extra]
    completed = recipes.run("bert_bookcorpus.py", *arguments, tmp_path=tmp_path, timeout=300)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads((output_dir / "pretraining_summary.json").read_text())


@pytest.mark.slow  # a whole recipe's smoke run (minutes on CI's 2 cores); its parts are tested by the fast tests
def test_bookcorpus_smoke_run_saves_a_loadable_checkpoint_and_resumes(recipes, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    output = tmp_path / "run"
    summary = run_bookcorpus_smoke(recipes, tmp_path, "no_dropout_no_wd_sam", output)
    assert summary["flatness_method"] == "sam" and summary["global_step"] == 30
    assert summary["hessian_trace"] > 0 and summary["eval_mlm_loss"] < 8.0

    tokenizer = AutoTokenizer.from_pretrained(output)
    model = AutoModelForMaskedLM.from_pretrained(output)
    assert len(tokenizer) == model.config.vocab_size == 2000
    assert model.config.hidden_dropout_prob == 0.0
    rows = mask_blocks_once(
        tokenize_into_blocks(Dataset.from_dict({"text": TEXTS}), tokenizer, block_size=16), tokenizer, seed=1
    )
    assert masked_lm_loss(model, rows) < 9.0  # a finite loss from the reloaded weights

    resumed = run_bookcorpus_smoke(recipes, tmp_path, "no_dropout_no_wd_sam", output, "--max_steps", "32")
    assert resumed["global_step"] == 32  # continued from checkpoint-30 rather than starting over
