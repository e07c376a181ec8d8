"""Checkpoint selection by flatness: the pure rule, the Trainer callback and the CLI, on constructed inputs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

from hf_flatbias.callbacks import FlatnessCheckpointSelector
from hf_flatbias.cli import main as cli_main
from hf_flatbias.selection import (
    CheckpointRecord,
    records_from_log_history,
    select_flattest_checkpoint,
)

# Losses and traces chosen by hand: step 300 has the lowest loss but is sharp; 400 is as good within 0.01 and the
# flattest; 100 is the flattest overall but its loss is 0.2 worse.
RECORDS = [
    CheckpointRecord(step=100, eval_loss=2.40, hessian_trace=3.0, stderr=0.1),
    CheckpointRecord(step=200, eval_loss=2.208, hessian_trace=9.0, stderr=0.5),
    CheckpointRecord(step=300, eval_loss=2.200, hessian_trace=12.0, stderr=0.5),
    CheckpointRecord(step=400, eval_loss=2.205, hessian_trace=6.0, stderr=0.5),
    CheckpointRecord(step=500, eval_loss=2.215, hessian_trace=4.0, stderr=0.5),
]


def test_flattest_within_absolute_tolerance():
    selection = select_flattest_checkpoint(RECORDS, loss_tolerance=0.01)
    assert selection.lowest_loss.step == 300
    assert [r.step for r in selection.candidates] == [200, 300, 400]
    assert selection.chosen.step == 400
    assert selection.loss_threshold == pytest.approx(2.21)


def test_wider_tolerance_admits_more_checkpoints():
    assert select_flattest_checkpoint(RECORDS, loss_tolerance=0.02).chosen.step == 500
    assert select_flattest_checkpoint(RECORDS, loss_tolerance=0.25).chosen.step == 100
    assert select_flattest_checkpoint(RECORDS, loss_tolerance=0.0).chosen.step == 300


def test_relative_tolerance_is_a_fraction_of_the_best_loss():
    # 0.5% of 2.2 = 0.011: admits 200, 300, 400 but not 500 (2.215 > 2.211).
    selection = select_flattest_checkpoint(RECORDS, loss_tolerance=0.005, relative_tolerance=True)
    assert [r.step for r in selection.candidates] == [200, 300, 400]
    assert selection.chosen.step == 400


def test_trace_margin_prefers_lower_loss_among_statistically_tied():
    records = [
        CheckpointRecord(step=1, eval_loss=1.000, hessian_trace=5.0, stderr=1.0),
        CheckpointRecord(step=2, eval_loss=1.004, hessian_trace=4.0, stderr=1.0),
        CheckpointRecord(step=3, eval_loss=1.008, hessian_trace=1.0, stderr=0.1),
    ]
    # No margin: the smallest estimate wins.
    assert select_flattest_checkpoint(records, loss_tolerance=0.01).chosen.step == 3
    # Margin 1: step 2 is within sqrt(1 + 0.01) of step 3? 4 - 1 = 3 > 1.005: no. With margin 3: yes (3 <= 3.015),
    # and step 1 (5 - 1 = 4 > 3.015) is not; the lower loss of {2, 3} is step 2.
    assert select_flattest_checkpoint(records, loss_tolerance=0.01, trace_margin=1.0).chosen.step == 3
    assert select_flattest_checkpoint(records, loss_tolerance=0.01, trace_margin=3.0).chosen.step == 2


def test_unmeasured_and_nonfinite_records_are_skipped():
    records = [
        CheckpointRecord(step=1, eval_loss=float("nan"), hessian_trace=0.5),
        CheckpointRecord(step=2, eval_loss=1.0, hessian_trace=None),
        CheckpointRecord(step=3, eval_loss=1.005, hessian_trace=7.0),
    ]
    selection = select_flattest_checkpoint(records, loss_tolerance=0.01)
    assert selection.lowest_loss.step == 2
    assert selection.chosen.step == 3


@pytest.mark.parametrize(
    "records, kwargs, message",
    [
        ([], {}, "no checkpoint has a finite eval_loss"),
        (RECORDS + [RECORDS[0]], {}, r"steps \[100\] appear more than once"),
        (RECORDS, {"loss_tolerance": -0.1}, "loss_tolerance must be"),
        (RECORDS, {"trace_margin": float("nan")}, "trace_margin must be"),
        ([CheckpointRecord(1, 1.0), CheckpointRecord(2, 2.0, 1.0)], {}, "has a trace; estimate it"),
    ],
)
def test_bad_input_is_rejected(records, kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_flattest_checkpoint(records, **kwargs)


def test_records_from_log_history_merges_entries_of_one_step(tmp_path):
    (tmp_path / "checkpoint-20").mkdir()
    history = [
        {"loss": 3.0, "step": 10},
        {"eval_loss": 2.5, "step": 10},
        {"flatness/hessian_trace": 4.0, "flatness/hessian_trace_stderr": 0.2, "step": 10},
        {"eval_loss": 2.4, "flatness/hessian_trace": 6.0, "step": 20},
        {"flatness/hessian_trace": 1.0, "step": 30},  # a trace without a loss is not a candidate
    ]
    records = records_from_log_history(history, checkpoint_dir=str(tmp_path))
    assert records == [
        CheckpointRecord(step=10, eval_loss=2.5, hessian_trace=4.0, stderr=0.2, path=None),
        CheckpointRecord(step=20, eval_loss=2.4, hessian_trace=6.0, stderr=None, path=str(tmp_path / "checkpoint-20")),
    ]


def test_record_needs_step_and_loss():
    with pytest.raises(ValueError, match=r"lacks \['eval_loss'\]"):
        CheckpointRecord.from_mapping({"step": 3})


def test_callback_rejects_bad_settings_at_construction():
    with pytest.raises(ValueError, match="loss_tolerance"):
        FlatnessCheckpointSelector(loss_tolerance=-1)


class _TinyMLMData(torch.utils.data.Dataset):
    def __init__(self, n=16, length=8, vocab=20, seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(4, vocab, (n, length), generator=generator)

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        ids = self.input_ids[index]
        labels = torch.full_like(ids, -100)
        labels[2] = ids[2]
        masked = ids.clone()
        masked[2] = 3
        return {"input_ids": masked, "attention_mask": torch.ones_like(ids), "labels": labels}


def _train_with_selector(tmp_path, selector, **overrides):
    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    model = BertForMaskedLM(config)
    settings = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_only_model=True,
    )
    settings.update(overrides)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**settings),
        train_dataset=_TinyMLMData(),
        eval_dataset=_TinyMLMData(n=8, seed=1),
        callbacks=[selector],
    )
    trainer.train()
    return trainer


def test_callback_points_best_checkpoint_at_the_flattest(tmp_path):
    # A fake trace that is smallest at step 2: with an enormous tolerance every checkpoint is a candidate, so the
    # choice must be step 2 whatever the losses are, and load_best_model_at_end must load that checkpoint.
    traces = iter([1.0, 50.0, 60.0])
    selector = FlatnessCheckpointSelector(loss_tolerance=100.0, trace_fn=lambda model: (next(traces), 0.1))
    trainer = _train_with_selector(tmp_path, selector, load_best_model_at_end=True)
    run = tmp_path / "run"
    assert sorted(selector.records) == [2, 4, 6]
    assert selector.selection.chosen.step == 2
    assert trainer.state.best_model_checkpoint == str(run / "checkpoint-2")
    saved = json.loads((run / "flatness_selection.json").read_text())
    assert saved["chosen"]["step"] == 2 and saved["chosen"]["hessian_trace"] == 1.0
    # The weights now in the trainer are those of checkpoint-2, not of the last step.
    reloaded = BertForMaskedLM.from_pretrained(run / "checkpoint-2")
    for (name, loaded), (_, live) in zip(
        reloaded.state_dict().items(), trainer.model.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(live, loaded, msg=name)


def test_callback_refuses_checkpoint_rotation(tmp_path):
    selector = FlatnessCheckpointSelector(trace_fn=lambda model: (1.0, 0.0))
    with pytest.raises(ValueError, match="save_total_limit=None"):
        _train_with_selector(tmp_path, selector, save_total_limit=1)


def _write_state(folder, history):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "trainer_state.json"), "w") as handle:
        json.dump({"log_history": history}, handle)


def test_cli_reads_newest_checkpoint_state(tmp_path, capsys):
    history = [{"eval_loss": r.eval_loss, "flatness/hessian_trace": r.hessian_trace, "step": r.step} for r in RECORDS]
    _write_state(tmp_path / "checkpoint-200", history[:2])
    for record in RECORDS:
        (tmp_path / f"checkpoint-{record.step}").mkdir(exist_ok=True)
    _write_state(tmp_path / "checkpoint-500", history)
    assert cli_main(["select", str(tmp_path), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["chosen"]["step"] == 400
    assert payload["chosen"]["path"] == str(tmp_path / "checkpoint-400")
    assert payload["lowest_loss"]["step"] == 300


def test_cli_reads_record_list_and_reports_errors(tmp_path, capsys):
    path = tmp_path / "records.json"
    path.write_text(
        json.dumps([{"step": r.step, "eval_loss": r.eval_loss, "hessian_trace": r.hessian_trace} for r in RECORDS])
    )
    assert cli_main(["select", str(path), "--loss-tolerance", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "chosen: step 500" in out
    assert cli_main(["select", str(path), "--loss-tolerance", "-1"]) == 2
    assert "loss_tolerance must be" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter importing transformers: about 20 s on the shared machine
def test_cli_entry_point_runs_as_a_process(tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"step": 1, "eval_loss": 1.0, "hessian_trace": 2.0}]))
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "hf_flatbias.cli", "select", str(path)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "chosen: step 1" in result.stdout


def test_callback_takes_traces_logged_by_another_callback_in_either_order(tmp_path):
    """HessianTraceCallback logs ``flatness/hessian_trace`` during the evaluation, before or after this callback."""
    from transformers import TrainerControl, TrainerState

    selector = FlatnessCheckpointSelector(loss_tolerance=0.05, trace_fn=lambda model: (999.0, 0.0))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    for step, loss, trace, log_first in [(10, 2.00, 9.0, True), (20, 2.03, 4.0, False), (30, 2.01, 6.0, True)]:
        state.global_step = step
        logs = {"flatness/hessian_trace": trace, "flatness/hessian_trace_stderr": 0.5}
        if log_first:
            selector.on_log(args, state, control, logs=logs)
        selector.on_evaluate(args, state, control, metrics={"eval_loss": loss}, model=object())
        if not log_first:  # logged after our on_evaluate: replaces the trace_fn fallback
            selector.on_log(args, state, control, logs=logs)
    selector.on_log(args, state, control, logs={"loss": 1.0})  # unrelated logs are ignored
    assert [(r.step, r.hessian_trace, r.stderr) for r in selector.records.values()] == [
        (10, 9.0, 0.5),
        (20, 4.0, 0.5),
        (30, 6.0, 0.5),
    ]
    selector.on_train_end(args, state, control)
    assert selector.selection.chosen.step == 20
    assert json.loads((tmp_path / "flatness_selection.json").read_text())["lowest_loss"]["step"] == 10


def test_cli_reads_a_recipe_result_file_with_other_key_names(tmp_path, capsys):
    """The research recipes' result files: {"records": [{step, loss, hessian_trace, hessian_trace_stderr, ...}]}."""
    records = [
        {"step": r.step, "loss": r.eval_loss, "hessian_trace": r.hessian_trace, "hessian_trace_stderr": r.stderr}
        for r in RECORDS
    ]
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"recipe": "continue_training", "records": records}))
    argv = ["select", str(path), "--loss-key", "loss", "--stderr-key", "hessian_trace_stderr", "--json"]
    assert cli_main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["chosen"]["step"] == 400 and payload["chosen"]["stderr"] == 0.5


def test_selector_ranks_by_the_median_of_means_when_asked(tmp_path):
    """Issue 55: a heavy-tailed trace (one step's mean carried by a few contexts) misranks under the mean; the median
    of means ranks it by its typical contexts. The default stays the mean."""
    from transformers import TrainerControl, TrainerState

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    by_summary = {}
    for summary in ("mean", "median_of_means"):
        selector = FlatnessCheckpointSelector(loss_tolerance=0.05, trace_summary=summary)
        state, control = TrainerState(), TrainerControl()
        for step, loss, mean, robust in [(10, 2.00, 179.7, 130.0), (20, 2.01, 150.0, 140.0)]:
            state.global_step = step
            logs = {
                "flatness/hessian_trace": mean,
                "flatness/hessian_trace_stderr": 5.0,
                "flatness/hessian_trace_median_of_means": robust,
            }
            selector.on_log(args, state, control, logs=logs)
            selector.on_evaluate(args, state, control, metrics={"eval_loss": loss})
        selector.on_train_end(args, state, control)
        by_summary[summary] = selector.selection.chosen.step
    assert by_summary == {"mean": 20, "median_of_means": 10}
    assert FlatnessCheckpointSelector().trace_summary == "mean"
    with pytest.raises(ValueError, match="trace_summary="):
        FlatnessCheckpointSelector(trace_summary="median")


def test_selector_trace_fn_gives_the_median_of_means():
    from hf_flatbias.flatness.results import TraceEstimate

    estimate = TraceEstimate(
        mean=9.0, stderr=1.0, n_contexts=30, n_draws=2, estimator="per_sample", seconds=0.1, median_of_means=7.0
    )
    selector = FlatnessCheckpointSelector(trace_summary="median_of_means", trace_fn=lambda model: estimate)
    assert selector.trace_metric == "flatness/hessian_trace_median_of_means"
    from hf_flatbias.callbacks.selector import _mean_and_stderr

    assert _mean_and_stderr(estimate, "median_of_means") == (7.0, 1.0)


def test_cli_selects_by_the_median_of_means(tmp_path, capsys):
    history = [
        {"step": 10, "eval_loss": 2.00},
        {"step": 10, "flatness/hessian_trace": 179.7, "flatness/hessian_trace_median_of_means": 130.0},
        {"step": 20, "eval_loss": 2.01},
        {"step": 20, "flatness/hessian_trace": 150.0, "flatness/hessian_trace_median_of_means": 140.0},
    ]
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({"log_history": history}))
    assert cli_main(["select", str(path), "--loss-tolerance", "0.05", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["step"] == 20
    assert (
        cli_main(["select", str(path), "--loss-tolerance", "0.05", "--trace-summary", "median_of_means", "--json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["chosen"]["step"] == 10
