"""GLUE metrics, data and fine-tuning, offline."""

from __future__ import annotations

import json
import logging
import urllib.request

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from safetensors.torch import load_file, save_file
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

from hf_flatbias import glue
from hf_flatbias.text_data import train_wordpiece_tokenizer

ALL_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any attempt to reach the Hub fails the test instead of waiting for a time-out."""

    def refuse(*args, **kwargs):
        raise AssertionError("the network was contacted")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    glue.hub_is_reachable.cache_clear()
    yield
    monkeypatch.undo()  # a test may have replaced hub_is_reachable itself
    glue.hub_is_reachable.cache_clear()


def _reference_scores(task: str, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
    if task == "cola":
        return {"matthews_correlation": matthews_corrcoef(references, predictions)}
    if task == "stsb":
        return {"pearson": pearsonr(predictions, references)[0], "spearmanr": spearmanr(predictions, references)[0]}
    accuracy = accuracy_score(references, predictions)
    if task in ("mrpc", "qqp"):
        return {"accuracy": accuracy, "f1": f1_score(references, predictions)}
    return {"accuracy": accuracy}


@pytest.mark.parametrize("task", ALL_TASKS)
def test_every_task_metric_matches_sklearn_scipy_offline(task):
    rng = np.random.default_rng(len(task))
    n = 257
    if task == "stsb":
        # float32 values: the metric stores its inputs as float32, like the Hub's.
        references = rng.uniform(0, 5, n).astype(np.float32)
        predictions = (references + rng.normal(0, 1.5, n)).astype(np.float32)
    else:
        num_classes = glue.get_glue_task(task).num_labels
        references = rng.integers(0, num_classes, n)
        predictions = np.where(rng.random(n) < 0.6, references, rng.integers(0, num_classes, n))

    metric = glue.load_glue_metric(task)  # offline (conftest): must fall back to the shipped module
    scores = metric.compute(predictions=predictions.tolist(), references=references.tolist())

    expected = _reference_scores(task, predictions, references)
    assert set(scores) == set(expected)
    for key, value in expected.items():
        assert scores[key] == pytest.approx(float(value), abs=1e-6), key


def test_metric_extra_configs_and_batches_accumulate():
    metric = glue.load_glue_metric("mnli_mismatched", use_hub=False)
    metric.add_batch(predictions=[0, 1, 2], references=[0, 1, 1])
    metric.add_batch(predictions=[2], references=[2])
    assert metric.compute() == {"accuracy": 0.75}


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="Unknown GLUE task 'sst5'.*cola, sst2"):
        glue.load_glue_metric("sst5")
    with pytest.raises(ValueError, match="Unknown GLUE task"):
        glue.parse_glue_tasks("sst2, imdb")
    with pytest.raises(ValueError, match="No GLUE task"):
        glue.parse_glue_tasks(" , ")
    assert [t.name for t in glue.parse_glue_tasks("SST2, qnli,rte")] == ["sst2", "qnli", "rte"]


def test_offline_mode_never_touches_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert glue.hub_is_reachable() is False  # the autouse fixture turns any request into a failure


def test_offline_glue_data_other_than_sst2_names_the_fix():
    with pytest.raises(ValueError, match="data_dir"):
        glue.load_glue_dataset("rte")


def test_sst2_standin_is_rotten_tomatoes_sentences():
    dataset = glue.load_glue_dataset("sst2")
    assert len(dataset["validation"]) == 872
    assert len(dataset["train"]) > 10_000
    assert set(dataset["train"]["label"]) == {0, 1}
    assert set(dataset["train"]["sentence"]).isdisjoint(dataset["validation"]["sentence"])


def test_local_files_load_for_sentence_pair_tasks(tmp_path):
    (tmp_path / "mnli").mkdir()
    header = "premise\thypothesis\tlabel\n"
    (tmp_path / "mnli" / "train.tsv").write_text(
        header + "A man sleeps.\tA person rests.\t0\nIt rains.\tIt is dry.\t2\n"
    )
    (tmp_path / "mnli" / "validation_matched.tsv").write_text(header + "Dogs bark.\tAnimals make noise.\t0\n")
    dataset = glue.load_glue_dataset("mnli", data_dir=tmp_path)
    assert dataset["train"]["hypothesis"] == ["A person rests.", "It is dry."]
    assert dataset["validation_matched"]["label"] == [0]

    with pytest.raises(ValueError, match="No 'train' file for GLUE task 'rte'"):
        glue.load_glue_dataset("rte", data_dir=tmp_path)


def test_labels_outside_the_task_are_rejected():
    with pytest.raises(ValueError, match="3 classes"):
        glue.check_labels(glue.get_glue_task("mnli"), [0, 1, 3])
    with pytest.raises(ValueError, match="label -1"):
        glue.check_labels(glue.get_glue_task("sst2"), [-1, -1])
    glue.check_labels(glue.get_glue_task("stsb"), [0.5, 4.2])


# --- checkpoints -----------------------------------------------------------------------------------------------

SENTENCES = [
    "a gripping and beautifully acted film",
    "the plot is dull and the jokes fall flat",
    "one of the best movies of the year",
    "a tedious mess that wastes its cast",
] * 8


def _tiny_config(vocab_size: int) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A masked-LM checkpoint saved with its tokenizer, as the BookCorpus recipe saves one."""
    folder = tmp_path_factory.mktemp("tiny_mlm")
    tokenizer = train_wordpiece_tokenizer(SENTENCES, vocab_size=80, min_frequency=1, cache_dir=folder / "cache")
    torch.manual_seed(0)
    BertForMaskedLM(_tiny_config(len(tokenizer))).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


def test_special_tokens_only_tokenizer_is_detected(tmp_path):
    BertForMaskedLM(_tiny_config(50)).save_pretrained(tmp_path)  # no tokenizer files
    with pytest.raises(ValueError, match="only special tokens"):
        glue.load_classifier(str(tmp_path), "sst2")


def test_loading_a_masked_lm_checkpoint_prints_no_load_report(tiny_checkpoint):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    report_logger = logging.getLogger("transformers.modeling_utils")
    report_logger.addHandler(handler)
    try:
        _, _, new_names = glue.load_classifier(str(tiny_checkpoint), "sst2")
    finally:
        report_logger.removeHandler(handler)
    assert any(name.startswith("classifier.") for name in new_names)  # the head is new: a report would list it
    assert not [record for record in records if "LOAD REPORT" in record.getMessage()]


def test_label_count_mismatch_of_an_existing_head(tmp_path, tiny_checkpoint):
    config = _tiny_config(80)
    config.num_labels = 3
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_checkpoint / name).read_bytes())
    with pytest.raises(ValueError, match="3 labels but sst2 needs 2.*reinitialize_head"):
        glue.load_classifier(str(tmp_path), "sst2")
    model, _, new_names = glue.load_classifier(str(tmp_path), "sst2", reinitialize_head=True)
    assert model.classifier.out_features == 2
    assert {"classifier.weight", "classifier.bias"} <= new_names
    model, _, _ = glue.load_classifier(str(tmp_path), "mnli")  # matching label count: the head is kept
    assert model.classifier.out_features == 3


def test_checkpoint_without_encoder_weights_is_rejected(tmp_path, tiny_checkpoint):
    weights = load_file(tiny_checkpoint / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_checkpoint / name).read_bytes())
    save_file({k: v for k, v in weights.items() if "embeddings" in k}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks encoder weights"):
        glue.load_classifier(str(tmp_path), "sst2")


def test_pooler_head_trains_only_the_new_pooler_and_classifier(tiny_checkpoint):
    model, _, new_names = glue.load_classifier(str(tiny_checkpoint), "rte")
    trainable = glue.probe_parameter_names(model, new_names)
    assert trainable == {"classifier.weight", "classifier.bias", "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    count = glue.freeze_all_but(model, trainable)
    assert count == 32 * 2 + 2 + 32 * 32 + 32
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad


def _toy_sst2() -> DatasetDict:
    positive = [s for s in SENTENCES if "best" in s or "gripping" in s]
    labels = [int(s in positive) for s in SENTENCES]
    data = Dataset.from_dict({"sentence": SENTENCES, "label": labels, "idx": list(range(len(SENTENCES)))})
    return DatasetDict(train=data, validation=data.select(range(8)))


@pytest.mark.parametrize("features", ["cls", "tokens"])
def test_linear_probe_has_exactly_one_trainable_linear_layer(tiny_checkpoint, features):
    model, tokenizer, _ = glue.load_classifier(str(tiny_checkpoint), "rte")
    probe = glue.LinearProbeClassifier(model.base_model, 2, features=features, n_positions=5)
    trainable = [(name, p) for name, p in probe.named_parameters() if p.requires_grad]
    assert [name for name, _ in trainable] == ["classifier.weight", "classifier.bias"]
    owners = [m for m in probe.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    assert len(owners) == 1 and isinstance(owners[0], torch.nn.Linear)
    assert owners[0].in_features == 32 * (1 if features == "cls" else 5)

    # The features are the frozen encoder's own states: [CLS], or positions 1..5 with zeros past a short input.
    probe.train()
    assert not probe.encoder.training  # no dropout in the frozen features
    encoded = tokenizer(["a dull film", "one of the best movies of the year"], padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model.base_model.eval()(**encoded).last_hidden_state
    captured = {}
    probe.classifier.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0]))
    probe.eval()
    output = probe(**encoded, labels=torch.tensor([0, 1]))
    if features == "cls":
        expected = states[:, 0]
    else:
        tokens = states[:, 1:6] * encoded["attention_mask"][:, 1:6, None]
        expected = tokens.flatten(1)
    assert torch.allclose(captured["x"], expected, atol=1e-6)
    output.loss.backward()
    assert all(p.grad is None for p in probe.encoder.parameters())


def test_finetune_modes_are_checked_by_name():
    assert [glue.resolve_finetune_mode(mode) for mode in glue.FINETUNE_MODES] == list(glue.FINETUNE_MODES)
    for unknown in ("linear_probe", "adapter"):  # linear_probe: what pooler_head was called before 0.1.0
        with pytest.raises(ValueError, match=f"mode='{unknown}' is not supported"):
            glue.resolve_finetune_mode(unknown)


def test_mean_interval_is_the_t_interval():
    values = [0.70, 0.74, 0.69, 0.73, 0.72]
    interval = glue.mean_interval(values)
    half = 2.7764451051977987 * np.std(values, ddof=1) / np.sqrt(5)  # t(0.975, 4)
    assert interval.estimate == pytest.approx(0.716)
    assert (interval.low, interval.high) == pytest.approx((0.716 - half, 0.716 + half))


def test_paired_interval_resolves_a_known_difference_that_unpaired_spreads_hide():
    rng = np.random.default_rng(0)
    covered, resolved, trials = 0, 0, 400
    for _ in range(trials):
        seed_effect = rng.normal(0, 0.03, size=5)  # what a seed does to both checkpoints alike
        a = 0.70 + 0.02 + seed_effect + rng.normal(0, 0.004, size=5)
        b = 0.70 + seed_effect + rng.normal(0, 0.004, size=5)
        difference = glue.paired_difference(a, b)
        covered += difference.low <= 0.02 <= difference.high
        resolved += difference.excludes_zero
    assert 0.92 <= covered / trials <= 0.98  # a 95% interval covers the true 2-point gap 95% of the time
    assert resolved / trials > 0.9  # and separates it from zero, though each one's seed spread (3 points) is larger
    with pytest.raises(ValueError, match="same seeds"):
        glue.paired_difference([0.1, 0.2], [0.1])


@pytest.mark.parametrize("mode", ["full", "linear_cls", "linear_tokens", "pooler_head"])
def test_finetune_glue_reports_every_seed(tiny_checkpoint, mode):
    result = glue.finetune_glue(
        str(tiny_checkpoint),
        "sst2",
        glue.GlueArguments(mode=mode, seeds=[0, 1]),
        glue.GlueConfig(
            max_steps=20 if mode == "full" else 5,  # only full fine-tuning is checked for learning
            learning_rate=5e-3,
            per_device_train_batch_size=8,
            disable_tqdm=True,
            use_cpu=True,
        ),
        dataset=_toy_sst2(),
    )
    assert result.seeds == [0, 1] and result.metric == "accuracy"
    assert result.scores == [m["accuracy"] for m in result.metrics]
    assert result.mean == pytest.approx(np.mean(result.scores))
    assert result.std == pytest.approx(np.std(result.scores, ddof=1))
    # Four distinct sentences repeated: full fine-tuning separates them; a probe on random features may not.
    if mode == "full":
        assert result.mean == 1.0


def test_finetune_glue_checks_before_training(tiny_checkpoint):
    with pytest.raises(ValueError, match="mode="):
        glue.finetune_glue(str(tiny_checkpoint), "sst2", glue.GlueArguments(mode="adapter"), dataset=_toy_sst2())
    bad = _toy_sst2()
    bad["train"] = bad["train"].map(lambda row: {"label": 5})
    with pytest.raises(ValueError, match="2 classes"):
        glue.finetune_glue(str(tiny_checkpoint), "sst2", config=glue.GlueConfig(max_steps=1), dataset=bad)


def test_cli_fine_tunes_from_local_files(tiny_checkpoint, tmp_path, capsys):
    from hf_flatbias.cli import main

    rows = "sentence,label\n" + "".join(f'"{s}",{int("best" in s or "gripping" in s)}\n' for s in SENTENCES)
    (tmp_path / "train.csv").write_text(rows)
    (tmp_path / "validation.csv").write_text(rows)
    argv = [
        "glue", str(tiny_checkpoint), "--task", "sst2", "--data-dir", str(tmp_path), "--seeds", "3",
        "--max-steps", "2", "--batch-size", "8", "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index('{\n  "model"') :])  # the Trainer prints its own logs first
    assert result["seeds"] == [3] and result["task"] == "sst2" and 0 <= result["mean"] <= 1


def test_hub_metric_failure_falls_back_to_the_local_module(monkeypatch):
    import evaluate

    real_load = evaluate.load
    asked = []

    def fake_load(path, *args, **kwargs):
        asked.append(path)
        if path == "glue":
            raise ConnectionError("simulated Hub failure")
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(evaluate, "load", fake_load)
    monkeypatch.setattr(glue.data, "hub_is_reachable", lambda: True)
    metric = glue.load_glue_metric("cola")
    assert asked[0] == "glue" and asked[1].endswith("metrics/glue")
    assert metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 1, 0]) == {"matthews_correlation": 1.0}
    with pytest.raises(ConnectionError):
        glue.load_glue_metric("cola", use_hub=True)


def test_stsb_is_fine_tuned_as_regression(tiny_checkpoint):
    pairs = Dataset.from_dict(
        {
            "sentence1": SENTENCES[:8],
            "sentence2": SENTENCES[1:9],
            "label": [0.5, 1.0, 4.5, 2.0, 3.0, 0.0, 5.0, 2.5],
            "idx": list(range(8)),
        }
    )
    result = glue.finetune_glue(
        str(tiny_checkpoint),
        "stsb",
        glue.GlueArguments(seeds=[0]),
        glue.GlueConfig(max_steps=3, learning_rate=1e-3, disable_tqdm=True, use_cpu=True),
        dataset=DatasetDict(train=pairs, validation=pairs),
    )
    assert result.metric == "pearson" and set(result.metrics[0]) == {"pearson", "spearmanr"}
    assert -1.0 <= result.mean <= 1.0
