"""Flatness model cards: rendering, reading back, building from a trainer, the CLI, and FlatBiasTrainer's saves."""

import dataclasses
import json
import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from transformers import BertConfig, BertForMaskedLM, TrainerCallback

from hf_flatbias.cli import main as cli_main
from hf_flatbias.config import FLATNESS_METHOD_HYPERPARAMETERS, FLATNESS_METHODS, SAM_METHODS, FlatBiasConfig
from hf_flatbias.corpus import CorpusSpec
from hf_flatbias.flatness import FlatnessRecord, TraceEstimate, estimate_hessian_trace
from hf_flatbias.modelcard import (
    METHOD_HYPERPARAMETERS,
    METHOD_TITLES,
    FlatnessCard,
    add_glue_results,
    flatness_card_from_trainer,
    format_comparison_table,
    load_flatness_card,
)
from hf_flatbias.modelcard.schema import schema
from hf_flatbias.trainer import FlatBiasTrainer


def front_matter(readme_path):
    text = open(readme_path, encoding="utf-8").read()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def full_card(**changes):
    values = dict(
        model_name="tiny-sam",
        method="sam",
        sam_rho=0.05,
        objective="masked_lm",
        trace_objective="masked_position",
        pretraining_loss=2.5,
        pretraining_loss_source="eval",
        hessian_trace=123.25,
        hessian_trace_stderr=4.5,
        trace_step=40,
        estimator="per_sample",
        n_contexts=64,
        n_draws=2,
        glue={"sst2": {"accuracy": 0.875}, "stsb": {"pearson": 0.5, "spearmanr": 0.25}},
        datasets=["bookcorpus"],
        license="apache-2.0",
        tags=["bert"],
        global_step=40,
        epoch=2.0,
        model_type="bert",
        num_parameters=1234,
        training_hyperparameters={"learning_rate": 0.001, "seed": 3},
    )
    values.update(changes)
    return FlatnessCard(**values)


# ----------------------------------------------------------------------------- the card file


def test_card_metadata_matches_the_issue_spec(tmp_path):
    full_card().save(tmp_path)
    meta = front_matter(tmp_path / "README.md")

    assert meta["flatness"]["hessian_trace"] == 123.25
    assert meta["flatness"]["hessian_trace_stderr"] == 4.5
    assert meta["flatness"]["estimator"] == "per_sample"
    assert (meta["flatness"]["n_contexts"], meta["flatness"]["n_draws"]) == (64, 2)
    assert (meta["flatness"]["method"], meta["flatness"]["sam_rho"]) == ("sam", 0.05)
    assert meta["flatness"]["pretraining_loss"] == 2.5
    assert {"hf_flatbias", "sam", "bert"} <= set(meta["tags"])

    metrics = {
        (r["dataset"]["type"], r["dataset"].get("config"), m["type"]): m
        for entry in meta["model-index"]
        for r in entry["results"]
        for m in r["metrics"]
    }
    trace = metrics[("bookcorpus", None, "hessian_trace")]
    assert trace["value"] == 123.25 and trace["args"]["stderr"] == 4.5 and trace["args"]["n_draws"] == 2
    assert metrics[("bookcorpus", None, "loss")]["value"] == 2.5
    assert metrics[("glue", "sst2", "accuracy")]["value"] == 0.875
    assert metrics[("glue", "stsb", "spearmanr")]["value"] == 0.25

    body = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "123.2 ± 4.5" in body and "SAM (sam_rho = 0.05)" in body
    assert "| Trace measured at step | 40 |" in body
    assert "pypi.org" not in body, "no link to a package page that may not exist"
    assert "arXiv" in body or "arxiv.org/abs/2210.14199" in body
    assert "| sst2 | accuracy | 0.8750 |" in body


def test_card_reads_back_as_the_same_typed_object(tmp_path):
    card = full_card()
    card.save(tmp_path)
    for source in (tmp_path, tmp_path / "README.md"):
        loaded = load_flatness_card(source)
        assert isinstance(loaded, FlatnessCard)
        assert loaded == card
        for name in (
            "model_name",
            "method",
            "sam_rho",
            "pretraining_loss",
            "hessian_trace",
            "hessian_trace_stderr",
            "trace_step",
            "estimator",
            "n_contexts",
            "n_draws",
            "glue",
            "datasets",
            "license",
            "tags",
        ):
            assert getattr(loaded, name) == getattr(card, name), name


def test_every_field_is_declared_in_the_schema_and_round_trips_when_set(tmp_path):
    """A field added to FlatnessCard without its card_field would be neither written nor read: this fails then."""
    assert [name for name, _ in schema(FlatnessCard)] == [item.name for item in dataclasses.fields(FlatnessCard)]
    card = full_card(
        method="asam",
        asam_eta=0.01,
        sam_every_k=2,
        trace_seconds=1.5,
        hessian_trace_by_group={"embeddings": {"mean": 1.0, "stderr": 0.5}},
        measures={"top_eigenvalue": {"value": 3.0, "matrix": "fisher", "k": 1, "step": 40}},
        pretraining_corpus=CorpusSpec("bbc_news", validation_texts=30),
        base_model="user/base",
        language=["en", "fr"],
        trainable_parameters=100,
        adapter="LORA",
        hessian_trace_median_of_means=11.0,
        median_of_means_groups=10,
        hessian_trace_top_share=0.02,
        top_share_contexts=3,
    )
    unused = set(METHOD_HYPERPARAMETERS) - set(FLATNESS_METHOD_HYPERPARAMETERS["asam"])
    for item in dataclasses.fields(FlatnessCard):
        if item.name in unused:
            continue
        assert getattr(card, item.name) not in (None, {}, []), f"set {item.name} in this test"
    card.save(tmp_path)
    assert load_flatness_card(tmp_path) == card


def test_the_pretraining_corpus_is_a_corpus_spec_written_as_its_record(tmp_path):
    spec = CorpusSpec("bbc_news", validation_texts=30, split_seed=2)
    record = spec.to_record()
    card = full_card(pretraining_corpus=record)  # the mapping a card's YAML holds is read as the spec
    assert card.pretraining_corpus == spec and full_card(pretraining_corpus={}).pretraining_corpus is None
    card.save(tmp_path)
    assert card.flatness_metadata()["pretraining_corpus"] == record
    assert load_flatness_card(tmp_path).pretraining_corpus == spec


def test_glue_results_added_later_are_merged_into_the_card(tmp_path):
    full_card().save(tmp_path)
    add_glue_results(tmp_path, {"sst2": {"f1": 0.5}, "rte": {"accuracy": 0.625}})
    meta = front_matter(tmp_path / "README.md")
    glue = {
        (r["dataset"]["config"], m["type"]): m["value"]
        for r in meta["model-index"][0]["results"]
        if r["dataset"]["type"] == "glue"
        for m in r["metrics"]
    }
    assert glue == {
        ("rte", "accuracy"): 0.625,
        ("sst2", "accuracy"): 0.875,
        ("sst2", "f1"): 0.5,
        ("stsb", "pearson"): 0.5,
        ("stsb", "spearmanr"): 0.25,
    }
    assert meta["flatness"]["hessian_trace"] == 123.25, "the rest of the card is unchanged"
    with pytest.raises(ValueError, match="not a finite number"):
        add_glue_results(tmp_path, {"rte": {"accuracy": float("nan")}})
    assert load_flatness_card(tmp_path).glue["rte"] == {"accuracy": 0.625}


def test_card_without_trace_or_sam_is_still_a_card(tmp_path):
    FlatnessCard(model_name="plain", pretraining_loss=3.0, pretraining_loss_source="train").save(tmp_path)
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "null" not in text, "keys without a value are left out, not written as null"
    meta = front_matter(tmp_path / "README.md")
    assert set(meta["flatness"]) == {"method", "pretraining_loss", "pretraining_loss_source"}
    assert "sam" not in meta["tags"]
    metric_types = [m["type"] for r in meta["model-index"][0]["results"] for m in r["metrics"]]
    assert metric_types == ["loss"]
    assert load_flatness_card(tmp_path).hessian_trace is None


@pytest.mark.parametrize(
    "changes, field_name",
    [
        ({"hessian_trace": float("nan")}, "hessian_trace"),
        ({"hessian_trace": float("inf")}, "hessian_trace"),
        ({"hessian_trace_stderr": float("nan")}, "hessian_trace_stderr"),
        ({"pretraining_loss": float("-inf")}, "pretraining_loss"),
    ],
)
def test_non_finite_numbers_are_refused_and_nothing_is_written(tmp_path, changes, field_name):
    with pytest.raises(ValueError, match=rf"{field_name}=.*not finite"):
        full_card(**changes).save(tmp_path)
    assert not (tmp_path / "README.md").exists()


def test_bad_cards_and_missing_cards_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="stderr must be >= 0"):
        full_card(hessian_trace_stderr=-1.0).validate()
    with pytest.raises(ValueError, match="method"):
        full_card(method="sgd").validate()
    with pytest.raises(ValueError, match="has no README.md"):
        load_flatness_card(tmp_path)
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# someone else's model\n")
    with pytest.raises(ValueError, match="no `flatness:` metadata block"):
        load_flatness_card(tmp_path)
    with pytest.raises(ValueError, match="neither an existing file or folder nor a Hub repo id"):
        load_flatness_card(str(tmp_path / "missing" / "deeper"))


def test_comparison_table_has_one_row_per_model_and_the_union_of_glue_columns():
    table = format_comparison_table(
        [
            ("a", full_card()),
            ("b", full_card(hessian_trace=None, hessian_trace_stderr=None, glue={"rte": {"accuracy": 0.5}})),
        ]
    )
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    header, a, b = rows[0], rows[2], rows[3]
    assert header[:3] == ["model", "pre-training loss", "Fisher trace Tr(F) ± stderr"]
    assert header[5:] == ["rte/accuracy", "sst2/accuracy", "stsb/pearson", "stsb/spearmanr"]
    assert a[:3] == ["a", "2.5", "123.2 ± 4.5"] and a[5:] == ["-", "0.8750", "0.5000", "0.2500"]
    assert b[2] == "-" and b[5:] == ["0.5000", "-", "-", "-"]


# ----------------------------------------------------------------------------- from a trainer, duck-typed


def fake_trainer(log_history, callbacks=(), method="sam"):
    args = SimpleNamespace(
        flatness_method=method,
        sam_rho=0.1,
        asam_eta=0.01,
        output_dir="/runs/my-run",
        hub_model_id=None,
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        world_size=1,
        seed=3,
    )
    state = SimpleNamespace(log_history=log_history, global_step=7, epoch=1.0)
    return SimpleNamespace(
        args=args, state=state, model=None, callback_handler=SimpleNamespace(callbacks=list(callbacks))
    )


def test_trainer_card_prefers_the_callback_estimate_and_eval_loss():
    estimate = TraceEstimate(mean=9.0, stderr=0.25, n_contexts=10, n_draws=3, estimator="per_sample", seconds=1.5)
    history = [
        {"loss": 4.0, "step": 1},
        {"eval_loss": 3.5, "step": 2},
        {"flatness/hessian_trace": 100.0, "flatness/hessian_trace_stderr": 1.0, "step": 2},
        {"loss": 3.0, "step": 3},
        {"eval_glue/sst2/accuracy": 0.75, "glue/rte/accuracy": 0.5, "step": 3},
    ]
    trainer = fake_trainer(
        history,
        callbacks=[
            SimpleNamespace(),  # a callback that keeps no record
            SimpleNamespace(flatness_record=FlatnessRecord()),  # one that has measured nothing yet
            SimpleNamespace(flatness_record=FlatnessRecord(trace=estimate, trace_step=2)),
        ],
    )
    card = flatness_card_from_trainer(trainer, glue_results={"rte": {"accuracy": 0.625}})

    assert (card.hessian_trace, card.hessian_trace_stderr, card.n_contexts, card.n_draws) == (9.0, 0.25, 10, 3)
    assert (card.pretraining_loss, card.pretraining_loss_source) == (3.5, "eval")
    assert card.glue == {"sst2": {"accuracy": 0.75}, "rte": {"accuracy": 0.625}}
    assert (card.method, card.sam_rho, card.asam_eta) == ("sam", 0.1, None)
    assert card.model_name == "my-run" and card.global_step == 7
    assert card.training_hyperparameters["total_train_batch_size"] == 8


def test_trainer_card_falls_back_to_the_log_history_and_train_loss():
    history = [
        {"flatness/hessian_trace": 100.0, "flatness/hessian_trace_stderr": 1.0, "step": 2},
        {"loss": 4.0, "step": 3},
        {"flatness/hessian_trace": 80.0, "flatness/hessian_trace_stderr": 2.0, "step": 4},
        {"loss": 3.0, "step": 5},
    ]
    card = flatness_card_from_trainer(fake_trainer(history, method="none"))
    assert (card.hessian_trace, card.hessian_trace_stderr) == (80.0, 2.0)
    assert (card.pretraining_loss, card.pretraining_loss_source) == (3.0, "train")
    assert card.method == "none" and card.sam_rho is None
    assert flatness_card_from_trainer(fake_trainer([])).hessian_trace is None


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "estimator, quantity",
    [("per_sample", "Fisher trace Tr(F)"), ("naive", "Fisher trace Tr(F)"), ("hutchinson", "Hessian trace Tr(H)")],
)
def test_the_trace_is_named_by_what_its_estimator_measured(tmp_path, estimator, quantity):
    card = full_card(estimator=estimator)
    text = card.save(tmp_path).read_text(encoding="utf-8")
    assert f"| {quantity} ± standard error | 123.2 ± 4.5 |" in text
    assert ("Hutchinson's estimate" in text) == (estimator == "hutchinson")
    other = "Hessian trace Tr(H)" if quantity.startswith("Fisher") else "Fisher trace Tr(F)"
    assert other not in text
    results = front_matter(tmp_path / "README.md")["model-index"][0]["results"]
    [trace] = [metric for result in results for metric in result["metrics"] if metric["type"] == "hessian_trace"]
    assert trace["name"] == f"{quantity} of the pre-training loss (masked position)"
    assert f"| {quantity} ± stderr |" in format_comparison_table([("a", card)])


def test_a_table_mixing_fisher_and_hessian_traces_names_neither():
    table = format_comparison_table([("a", full_card()), ("b", full_card(estimator="hutchinson"))])
    assert "| trace ± stderr |" in table.splitlines()[0]


def test_cli_card_and_compare(tmp_path, capsys):
    flat, sharp = tmp_path / "flat", tmp_path / "sharp"
    full_card(hessian_trace=50.0).save(flat)
    full_card(hessian_trace=500.0, method="none", sam_rho=None).save(sharp)

    assert cli_main(["card", str(flat), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["hessian_trace"] == 50.0 and shown["glue"]["sst2"]["accuracy"] == 0.875

    assert cli_main(["card", str(flat)]) == 0
    summary = capsys.readouterr().out
    assert "| Fisher trace Tr(F) ± stderr | 50 ± 4.5 |" in summary
    assert "| estimator | per_sample, 64 contexts × 2 draws |" in summary
    assert "| GLUE stsb/spearmanr | 0.2500 |" in summary

    assert cli_main(["compare", str(sharp), str(flat), "--sort", "trace"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4
    assert lines[2].startswith(f"| {flat} |") and lines[3].startswith(f"| {sharp} |")
    assert "SAM (sam_rho = 0.05)" in lines[2] and "| none |" in lines[3]

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README.md").write_text("# no metadata\n")
    assert cli_main(["compare", str(flat), str(tmp_path / "other")]) == 2
    assert "no `flatness:` metadata block" in capsys.readouterr().err


# ----------------------------------------------------------------------------- FlatBiasTrainer writes the card


class FixedTraceCallback(TrainerCallback):
    """Stands in for HessianTraceCallback: only its `flatness_record` matters to the card."""

    def __init__(self, mean, stderr=0.5):
        estimate = TraceEstimate(
            mean=mean, stderr=stderr, n_contexts=8, n_draws=2, estimator="per_sample", seconds=0.01
        )
        self.flatness_record = FlatnessRecord(trace=estimate)


def tiny_mlm_setup(seed=0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = BertForMaskedLM(config)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 40, (16, 8), generator=generator)
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    data = [{"input_ids": row, "labels": target} for row, target in zip(ids, labels, strict=True)]
    return model, data


def tiny_args(output_dir, **overrides):
    values = dict(
        flatness_method="sam",
        sam_rho=0.05,
        max_steps=4,
        per_device_train_batch_size=4,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    values.update(overrides)
    return FlatBiasConfig(str(output_dir), **values)


def test_trainer_writes_the_flatness_card_with_every_checkpoint_and_save(tmp_path):
    model, data = tiny_mlm_setup()
    trainer = FlatBiasTrainer(
        model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[FixedTraceCallback(12.5)]
    )
    trainer.train()

    train_losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    for step in (2, 4):
        meta = front_matter(tmp_path / f"checkpoint-{step}" / "README.md")
        assert meta["flatness"]["hessian_trace"] == 12.5 and meta["flatness"]["method"] == "sam"
        assert meta["flatness"]["global_step"] == step
        assert math.isclose(meta["flatness"]["pretraining_loss"], train_losses[step], rel_tol=1e-6)
        assert "generated_from_trainer" not in meta["tags"]  # transformers' card would carry this tag

    trainer.create_model_card(license="mit", tags=["tiny"], dataset="synthetic")
    meta = front_matter(tmp_path / "README.md")
    assert meta["license"] == "mit" and {"hf_flatbias", "sam", "tiny"} <= set(meta["tags"])
    trainer.save_model(str(tmp_path / "final"))
    meta = front_matter(tmp_path / "final" / "README.md")
    assert meta["license"] == "mit" and meta["datasets"] == ["synthetic"], "metadata given once is kept"


class LogsTraceCallback(TrainerCallback):
    """Logs the trace through the trainer at every step, as HessianTraceCallback does, and keeps no estimate."""

    def bind_trainer(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.log({"flatness/hessian_trace": 10.0 * state.global_step, "flatness/hessian_trace_stderr": 1.0})


def test_trainer_card_reads_a_trace_logged_through_the_trainer(tmp_path):
    model, data = tiny_mlm_setup()
    trainer = FlatBiasTrainer(
        model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[LogsTraceCallback()]
    )
    trainer.train()
    for step in (2, 4):
        meta = front_matter(tmp_path / f"checkpoint-{step}" / "README.md")
        assert (meta["flatness"]["hessian_trace"], meta["flatness"]["hessian_trace_stderr"]) == (10.0 * step, 1.0)
    card_size = front_matter(tmp_path / "checkpoint-4" / "README.md")["flatness"]["num_parameters"]
    assert card_size == model.num_parameters()


def test_trainer_card_carries_the_hessian_trace_callback_estimate(tmp_path):
    from hf_flatbias.callbacks import HessianTraceCallback

    model, data = tiny_mlm_setup()
    trace = HessianTraceCallback(
        eval_dataset=[{"input_ids": row["input_ids"].tolist()} for row in data[:6]],
        n_contexts=6,
        n_draws=2,
        every_n_steps=2,
        on_evaluate=False,
        mask_token_id=4,
    )
    trainer = FlatBiasTrainer(model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[trace])
    trainer.train()
    logged = {e["step"]: e for e in trainer.state.log_history if "flatness/hessian_trace" in e}
    for step in (2, 4):
        flatness = front_matter(tmp_path / f"checkpoint-{step}" / "README.md")["flatness"]
        assert flatness["hessian_trace"] == logged[step]["flatness/hessian_trace"] > 0
        assert flatness["hessian_trace_stderr"] == logged[step]["flatness/hessian_trace_stderr"]
        assert (flatness["n_contexts"], flatness["n_draws"], flatness["estimator"]) == (6, 2, "per_sample")
        assert flatness["trace_step"] == step


def test_trace_split_by_group_is_logged_and_carried_by_the_card(tmp_path):
    from hf_flatbias.callbacks import HessianTraceCallback

    model, data = tiny_mlm_setup()
    trace = HessianTraceCallback(
        eval_dataset=[{"input_ids": row["input_ids"].tolist()} for row in data[:6]],
        n_contexts=6,
        every_n_steps=4,
        on_evaluate=False,
        mask_token_id=4,
        by_group=True,
    )
    trainer = FlatBiasTrainer(model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[trace])
    trainer.train()
    (logged,) = [e for e in trainer.state.log_history if "flatness/hessian_trace" in e]
    groups = ["embeddings", "block.0", "head", "output_layer"]
    parts = [logged[f"flatness/hessian_trace/{group}"] for group in groups]
    assert sum(parts) == pytest.approx(logged["flatness/hessian_trace"], rel=1e-12)
    card = load_flatness_card(tmp_path / "checkpoint-4")
    assert list(card.hessian_trace_by_group) == groups
    for group, value in zip(groups, parts, strict=True):
        assert card.hessian_trace_by_group[group]["mean"] == value
        assert card.hessian_trace_by_group[group]["stderr"] == trace.last_estimate.by_group[group].stderr > 0


def test_the_split_by_group_round_trips_and_non_finite_parts_are_refused(tmp_path):
    split = {"embeddings": {"mean": 3.5, "stderr": 0.25}, "output_layer": {"mean": 1.0, "stderr": 0.125}}
    card = full_card(hessian_trace_by_group=split)
    card.save(tmp_path)
    assert front_matter(tmp_path / "README.md")["flatness"]["hessian_trace_by_group"] == split
    assert load_flatness_card(tmp_path) == card
    assert "hessian_trace_by_group" not in front_matter(full_card().save(tmp_path / "plain"))["flatness"]
    with pytest.raises(ValueError, match=r"hessian_trace_by_group\['output_layer'\]\['mean'\]=nan"):
        full_card(hessian_trace_by_group={"output_layer": {"mean": float("nan"), "stderr": 0.1}}).save(tmp_path / "x")


def test_trainer_keeps_checkpoints_but_skips_a_non_finite_card(tmp_path, caplog):
    model, data = tiny_mlm_setup()
    trainer = FlatBiasTrainer(
        model=model,
        args=tiny_args(tmp_path, max_steps=2),
        train_dataset=data,
        callbacks=[FixedTraceCallback(float("nan"))],
    )
    trainer.train()
    assert os.path.isfile(tmp_path / "checkpoint-2" / "model.safetensors")
    assert not os.path.exists(tmp_path / "checkpoint-2" / "README.md")
    with pytest.raises(ValueError, match="hessian_trace=nan.*not finite"):
        trainer.create_model_card()


def test_only_world_rank_zero_writes_cards(tmp_path, monkeypatch):
    model, data = tiny_mlm_setup()
    trainer = FlatBiasTrainer(
        model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[FixedTraceCallback(1.0)]
    )
    monkeypatch.setattr(trainer, "is_world_process_zero", lambda: False)
    trainer.create_model_card()
    trainer.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "README.md").exists() and not (tmp_path / "saved" / "README.md").exists()


# ----------------------------------------------------------------------------- every method has a card


@pytest.mark.parametrize("method", FLATNESS_METHODS)
def test_every_config_method_gets_a_card_recording_exactly_its_hyperparameters(tmp_path, method):
    args = tiny_args(tmp_path, flatness_method=method, sam_every_k=3 if method in SAM_METHODS else 1)
    trainer = SimpleNamespace(
        args=args,
        state=SimpleNamespace(log_history=[{"loss": 2.0, "step": 5}], global_step=5, epoch=1.0),
        model=None,
        callback_handler=SimpleNamespace(callbacks=[FixedTraceCallback(9.0)]),
    )
    flatness_card_from_trainer(trainer).save(tmp_path)

    card = ModelCard.load(tmp_path / "README.md")  # the Hub's own parser
    flatness = card.data.flatness
    assert flatness["method"] == method
    recorded = {name for name in flatness if name in METHOD_HYPERPARAMETERS}
    assert recorded == set(FLATNESS_METHOD_HYPERPARAMETERS[method])
    for name in recorded:
        assert flatness[name] == getattr(args, name), name
    assert ("sam_rho" in flatness) == (method in SAM_METHODS), "no sam_rho on a penalty or plain run"
    assert METHOD_TITLES[method] in card.text
    assert load_flatness_card(tmp_path).method == method


def test_card_method_titles_cover_the_config_methods_and_nothing_else():
    assert set(METHOD_TITLES) == set(FLATNESS_METHODS) == set(FLATNESS_METHOD_HYPERPARAMETERS)


def test_a_hyperparameter_the_method_does_not_read_is_refused():
    with pytest.raises(ValueError, match="sam_rho is set but method 'fisher_penalty' does not use it"):
        full_card(method="fisher_penalty").validate()
    full_card(method="fisher_penalty", sam_rho=None, penalty_lambda=0.01, penalty_fd_step=0.01).validate()


def test_training_block_shows_max_steps_when_it_overrides_the_epochs(tmp_path):
    def recorded(**overrides):
        args = tiny_args(tmp_path, **overrides)
        trainer = SimpleNamespace(args=args, state=SimpleNamespace(log_history=[], global_step=0, epoch=None))
        return flatness_card_from_trainer(trainer).training_hyperparameters

    by_steps = recorded(max_steps=4, num_train_epochs=3)
    assert by_steps["max_steps"] == 4 and "num_train_epochs" not in by_steps
    by_epochs = recorded(max_steps=-1, num_train_epochs=3)
    assert by_epochs["num_train_epochs"] == 3 and "max_steps" not in by_epochs


# ----------------------------------------------------------------------------- the trace of the saved weights


def trace_callback(data, **options):
    from hf_flatbias.callbacks import HessianTraceCallback

    rows = [{"input_ids": row["input_ids"].tolist()} for row in data[:6]]
    return HessianTraceCallback(
        eval_dataset=rows, n_contexts=6, n_draws=2, on_evaluate=False, mask_token_id=4, **options
    )


def test_the_last_checkpoint_carries_the_trace_of_its_own_weights(tmp_path):
    model, data = tiny_mlm_setup()
    trace = trace_callback(data, every_n_steps=3)
    trainer = FlatBiasTrainer(model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[trace])
    trainer.train()

    measured = [e["step"] for e in trainer.state.log_history if "flatness/hessian_trace" in e]
    assert measured == [3, 4], "every 3 steps, and once more at the last step"
    assert "hessian_trace" not in front_matter(tmp_path / "checkpoint-2" / "README.md")["flatness"]
    flatness = front_matter(tmp_path / "checkpoint-4" / "README.md")["flatness"]
    assert flatness["trace_step"] == flatness["global_step"] == 4
    # an independent estimate on the final weights, with the callback's contexts and seed
    expected = estimate_hessian_trace(trainer.model, trace._contexts, n_draws=2, seed=0)
    assert flatness["hessian_trace"] == pytest.approx(expected.mean, rel=1e-6)


def test_measure_at_end_can_be_turned_off_and_the_card_then_says_how_old_the_trace_is(tmp_path):
    model, data = tiny_mlm_setup()
    trace = trace_callback(data, every_n_steps=3, measure_at_end=False)
    trainer = FlatBiasTrainer(model=model, args=tiny_args(tmp_path), train_dataset=data, callbacks=[trace])
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "flatness/hessian_trace" in e] == [3]
    flatness = front_matter(tmp_path / "checkpoint-4" / "README.md")["flatness"]
    assert (flatness["trace_step"], flatness["global_step"]) == (3, 4)
    body = (tmp_path / "checkpoint-4" / "README.md").read_text(encoding="utf-8")
    assert "| Trace measured at step | 3 (these weights are from step 4) |" in body


# ----------------------------------------------------------------------------- reading cards that went wrong


def write_card(folder, flatness_yaml):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text(f"---\nflatness:\n{flatness_yaml}\n---\n# hand-edited\n", encoding="utf-8")
    return folder


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_traces_are_read_as_unknown_with_a_warning_naming_file_and_field(tmp_path, value):
    folder = write_card(tmp_path / "a", f"  method: none\n  hessian_trace: {value}\n  hessian_trace_stderr: 1.0")
    with pytest.warns(UserWarning, match=r"a/README.md: flatness.hessian_trace is .*not a finite number"):
        card = load_flatness_card(folder)
    assert card.hessian_trace is None and card.hessian_trace_stderr is None


@pytest.mark.parametrize(
    "flatness_yaml, message",
    [
        ("  method: none\n  hessian_trace: twelve", r"flatness.hessian_trace is 'twelve', not a number"),
        ("  method: none\n  n_contexts: 2.5", r"flatness.n_contexts is 2.5, not a whole number"),
        ("  method: sgd", r"flatness.method is 'sgd'"),
        ("  method: none\n  pretraining_corpus: {dataset: bbc_news}", r"flatness.pretraining_corpus is .*text_column"),
        ("  method: none\n  hessian_trace: [1", r"YAML metadata cannot be read"),
    ],
)
def test_broken_cards_are_refused_with_the_file_and_field_named(tmp_path, capsys, flatness_yaml, message):
    folder = write_card(tmp_path / "broken", flatness_yaml)
    with pytest.raises(ValueError, match=message) as error:
        load_flatness_card(folder)
    assert str(folder / "README.md") in str(error.value)
    for command in (["card", str(folder)], ["compare", str(folder)]):
        assert cli_main(command) == 2
        err = capsys.readouterr().err
        assert str(folder / "README.md") in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_compare_sorts_unknown_and_nan_traces_last(tmp_path, capsys):
    nan = write_card(tmp_path / "nan", "  method: none\n  hessian_trace: .nan")
    missing = write_card(tmp_path / "missing", "  method: none")
    low, high = tmp_path / "low", tmp_path / "high"
    full_card(hessian_trace=5.0).save(low)
    full_card(hessian_trace=50.0).save(high)
    assert cli_main(["compare", str(nan), str(high), str(missing), str(low), "--sort", "trace"]) == 0
    captured = capsys.readouterr()
    rows = [line.split("|")[1].strip() for line in captured.out.strip().splitlines()[2:]]
    assert rows[:2] == [str(low), str(high)] and set(rows[2:]) == {str(nan), str(missing)}
    assert "warning:" in captured.err and "flatness.hessian_trace is nan" in captured.err


# ----------------------------------------------------------------------------- what was trained (issue 38)


def model_index_task(readme_path):
    [entry] = front_matter(readme_path)["model-index"]
    tasks = {(result["task"]["type"], result["task"]["name"]) for result in entry["results"]}
    [task] = tasks
    return task


def test_a_masked_lm_pretrained_by_flatbias_trainer_says_so(tmp_path):
    model, data = tiny_mlm_setup()
    trainer = FlatBiasTrainer(
        model=model, args=tiny_args(tmp_path, max_steps=2), train_dataset=data, callbacks=[FixedTraceCallback(12.5)]
    )
    trainer.train()
    card = load_flatness_card(tmp_path / "checkpoint-2")
    assert (card.objective, card.trace_objective, card.pretraining_loss_source) == (
        "masked_lm",
        "masked_position",
        "train",
    )
    assert card.loss_label == "Pre-training loss (masked LM) (training, last logged)"
    assert card.trainable_parameters == card.num_parameters == model.num_parameters()
    assert card.adapter is None and card.base_model is None
    assert model_index_task(tmp_path / "checkpoint-2" / "README.md") == (
        "fill-mask",
        "Masked language modeling (pre-training)",
    )
    body = (tmp_path / "checkpoint-2" / "README.md").read_text(encoding="utf-8")
    assert "| Trace measured on | the token at one masked position per context |" in body
    assert "f(x_-t)" in body


def test_a_causal_lm_pretrained_by_flatbias_trainer_is_not_called_a_masked_lm(tmp_path):
    from tests.helpers.tiny_models import tiny_llama

    model = tiny_llama(40)
    ids = torch.randint(5, 40, (8, 8), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = FlatBiasTrainer(
        model=model, args=tiny_args(tmp_path, max_steps=2), train_dataset=data, callbacks=[FixedTraceCallback(3.0)]
    )
    trainer.train()
    card = load_flatness_card(tmp_path / "checkpoint-2")
    assert (card.objective, card.trace_objective) == ("causal_lm", "next_token")
    assert card.loss_label == "Pre-training loss (next token) (training, last logged)"
    assert card.trainable_parameters == card.num_parameters == model.num_parameters()
    readme = tmp_path / "checkpoint-2" / "README.md"
    assert model_index_task(readme) == ("text-generation", "Causal language modeling (pre-training)")
    body = readme.read_text(encoding="utf-8")
    assert "| Trace measured on | the next token at one position per context |" in body
    assert "f(x_<t)" in body and "masked" not in body.lower()


def test_what_was_trained_leaves_what_it_cannot_tell_unknown():
    from transformers import Trainer

    from hf_flatbias.modelcard.objective import what_was_trained

    classifier = what_was_trained(Trainer, None, loss_source="eval")
    assert (classifier.objective, classifier.trace_objective, classifier.loss_source) == (None, None, "eval")
    OtherTrl = type("GRPOTrainer", (Trainer,), {"__module__": "trl.trainer.grpo_trainer"})
    assert what_was_trained(OtherTrl, "causal_lm").objective is None
    peft = SimpleNamespace(peft_type=SimpleNamespace(value="LORA"), base_model_name_or_path="org/base")
    with_lora = what_was_trained(FlatBiasTrainer, "causal_lm", peft_config=peft)
    assert (with_lora.objective, with_lora.adapter, with_lora.base_model) == ("causal_lm", "LORA", "org/base")
    with pytest.raises(ValueError, match="loss_source"):
        what_was_trained(Trainer, "masked_lm", loss_source="test")


OLD_CARD = """---
library_name: transformers
tags:
- hf_flatbias
- sam
- flatness
flatness:
  hessian_trace: 3.25
  hessian_trace_stderr: 0.5
  trace_step: 2
  estimator: per_sample
  n_contexts: 6
  n_draws: 2
  method: sam
  sam_rho: 0.05
  pretraining_loss: 0.677
  pretraining_loss_source: train
  global_step: 2
  model_type: llama
  num_parameters: 25888
model-index:
- name: old
  results:
  - task:
      type: fill-mask
      name: Masked language modeling (pre-training loss)
    dataset:
      name: pre-training corpus
      type: pretraining-corpus
    metrics:
    - type: loss
      value: 0.677
      name: Pre-training loss (train)
---
# old
"""


def test_a_card_written_before_the_objective_fields_reads_as_unknown_not_as_pretraining(tmp_path):
    (tmp_path / "README.md").write_text(OLD_CARD, encoding="utf-8")
    card = load_flatness_card(tmp_path)
    assert (card.pretraining_loss, card.hessian_trace, card.num_parameters) == (0.677, 3.25, 25888)
    assert card.objective is card.trace_objective is card.trainable_parameters is card.adapter is None
    assert card.loss_label == "Loss (objective not recorded) (training, last logged)"
    card = add_glue_results(tmp_path, {"sst2": {"accuracy": 0.5}})  # written again: the labels say unknown
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "fill-mask" not in text and "Pre-training loss" not in text
    assert "| Training objective | Training objective not recorded |" in text
    assert "masked or next: not recorded on this card" in text
    assert load_flatness_card(tmp_path) == card
    for field_name, value in (("objective", "pretraining"), ("trace_objective", "masked")):
        with pytest.raises(ValueError, match=field_name):
            full_card(**{field_name: value}).validate()


def test_a_base_model_folder_from_the_peft_config_is_named_but_not_linked_to_the_hub():
    local = FlatnessCard("x", base_model="/models/base", adapter="LORA").render()
    assert "`/models/base` (LORA adapters on it)" in local and "huggingface.co//models" not in local
    assert "[org/base](https://huggingface.co/org/base)" in FlatnessCard("x", base_model="org/base").render()


# ----------------------------------------------------------------------------- values no measurement gives (issue 58)

QUANTIZED = {"value": 0.25, "stderr": 0.03, "bits": 4, "granularity": "per_channel", "relative_weight_error": 0.1,
             "base_loss": 2.5, "n_contexts": 64, "bit_widths": [8, 4], "increases": [0.01, 0.25],
             "stderrs": [0.001, 0.03]}  # fmt: skip
NOISED = {"value": 0.01, "stderr": 0.002, "sigma": 0.02, "scale": "rms", "n_draws": 8, "base_loss": 2.5}
FORGOT = {"value": 0.1, "stderr": 0.01, "steps": 50, "accuracy_before": 0.5, "accuracy_after": 0.75}


@pytest.mark.parametrize(
    "name,record,message",
    [
        ("forgetting", {**FORGOT, "accuracy_after": 1.7}, "['forgetting']['accuracy_after'] is 1.7, outside 0 to 1"),
        ("quantization", {**QUANTIZED, "bits": 16}, "['quantization']['bits'] is 16, outside 2 to 8"),
        ("quantization", {**QUANTIZED, "bit_widths": [16, 4]}, "['quantization']['bit_widths'] is 16, outside 2 to 8"),
        ("quantization", {**QUANTIZED, "relative_weight_error": -0.1}, "['relative_weight_error'] is -0.1, outside >="),
        ("weight_noise", {**NOISED, "sigma": -0.02}, "['weight_noise']['sigma'] is -0.02, outside >= 0"),
        ("quantization", {**QUANTIZED, "stderrs": [0.001, -0.1]}, "['quantization']['stderrs'] is -0.1, outside >= 0"),
    ],
)  # fmt: skip
def test_a_value_no_measurement_gives_is_refused_on_write_and_on_read(tmp_path, name, record, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        full_card(measures={name: record}).save(tmp_path / "written")
    assert not (tmp_path / "written" / "README.md").exists()
    # a hand-edited card: refused when read, naming the file and the field
    good = {"forgetting": FORGOT, "quantization": QUANTIZED, "weight_noise": NOISED}[name]
    full_card(measures={name: good}).save(tmp_path / "edited")
    readme = tmp_path / "edited" / "README.md"
    text = readme.read_text()
    meta = front_matter(readme)
    meta["flatness"][name] = record
    readme.write_text("---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n" + text.split("---\n", 2)[2])
    key = message.split("]['")[-1].split("']")[0] if "][" in message else message.split("['")[1].split("']")[0]
    with pytest.raises(ValueError, match=re.escape(f"flatness.{name}.{key} is")) as refused:
        load_flatness_card(tmp_path / "edited")
    assert str(readme) in str(refused.value)


def test_a_negative_standard_error_is_refused_when_read(tmp_path, capsys):
    """compare printed it as `+- -0.1`."""
    folder = write_card(tmp_path / "neg", "  method: none\n  sam_sharpness: {value: 0.5, stderr: -0.1, rho: 0.05}")
    with pytest.raises(ValueError, match=r"flatness.sam_sharpness.stderr is -0.1, outside >= 0"):
        load_flatness_card(folder)
    assert cli_main(["compare", str(folder)]) == 2 and "+- -0.1" not in capsys.readouterr().out


def test_whole_number_lists_come_back_as_whole_numbers(tmp_path, capsys):
    full_card(measures={"quantization": QUANTIZED}).save(tmp_path)
    record = load_flatness_card(tmp_path).measures["quantization"]
    assert record["bit_widths"] == [8, 4] and all(type(bits) is int for bits in record["bit_widths"])
    assert cli_main(["card", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "at 8 bit" in out and "8.0 bit" not in out


def test_compare_sorts_by_every_measure_the_cards_carry(tmp_path, capsys):
    from hf_flatbias.measures import EXTRA_MEASURES

    for value, name in ((0.5, "b"), (0.125, "a"), (None, "c")):
        measures = {} if value is None else {"weight_noise": {**NOISED, "value": value}}
        full_card(measures=measures).save(tmp_path / name)
    folders = [str(tmp_path / name) for name in "bca"]
    assert cli_main(["compare", *folders, "--sort", "weight_noise"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.strip().splitlines()[2:]]
    assert rows == [str(tmp_path / name) for name in "abc"]  # unknown last
    from hf_flatbias.cli import build_parser

    for name in EXTRA_MEASURES:  # every measure of the table is a --sort key
        assert build_parser().parse_args(["compare", "x", "--sort", name]).sort == name


@pytest.mark.parametrize(
    "objective,key",
    [
        ("dpo", "dpo_loss"),
        ("sft_completion_only", "sft_loss"),
        ("masked_lm", "pretraining_loss"),
        (None, "pretraining_loss"),
    ],
)
def test_the_cards_loss_key_names_what_the_run_trained_on(tmp_path, objective, key):
    """Issue 58, item 6: SFT and DPO cards wrote their loss under `pretraining_loss`."""
    full_card(objective=objective, pretraining_loss=0.625, pretraining_loss_source="train").save(tmp_path / "new")
    flatness = front_matter(tmp_path / "new" / "README.md")["flatness"]
    assert flatness[key] == 0.625 and flatness[f"{key}_source"] == "train"
    assert key == "pretraining_loss" or not {"pretraining_loss", "pretraining_loss_source"} & set(flatness)
    card = load_flatness_card(tmp_path / "new")
    assert (card.pretraining_loss, card.pretraining_loss_source) == (0.625, "train")
    # a card written before: the key said pretraining_loss whatever the objective
    old = f"  method: none\n  objective: {objective}\n" if objective else "  method: none\n"
    folder = write_card(tmp_path / "old", old + "  pretraining_loss: 0.5\n  pretraining_loss_source: eval")
    assert (load_flatness_card(folder).pretraining_loss, load_flatness_card(folder).pretraining_loss_source) == (
        0.5,
        "eval",
    )
