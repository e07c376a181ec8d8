"""HessianTraceCallback inside real Trainer runs: logged values, no effect on training, binding."""

import dataclasses
import signal

import pytest
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_flatbias.callbacks import (
    TRACE_METRIC,
    TRACE_STDERR_METRIC,
    HessianTraceCallback,
    SaveOnInterruptCallback,
    TraceCallbackConfig,
    contexts_within_budget,
)
from hf_flatbias.flatness import FlatnessRecord, TraceEstimate, estimate_hessian_trace
from hf_flatbias.trainer import FlatBiasTrainer
from tests.helpers.tiny_models import (
    MLM_WORDS,
    assert_training_unchanged,
    train_word_mlm,
    word_mlm,
    word_mlm_tokenizer,
    word_rows,
)


@pytest.fixture(scope="module")
def tokenizer():
    return word_mlm_tokenizer()


class _LogRecorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_logged_values_reach_log_history_and_reporters_without_changing_training(tmp_path, tokenizer):
    plain = train_word_mlm(tmp_path / "plain", tokenizer, [])
    trace = HessianTraceCallback(n_contexts=6, n_draws=2, every_n_steps=2, max_overhead=None)
    reporter = _LogRecorder()
    measured = train_word_mlm(tmp_path / "measured", tokenizer, [trace, reporter])

    traced = [entry for entry in measured.state.log_history if TRACE_METRIC in entry]
    # every 2 steps (2, 4, 6) and after each evaluation (3, 6; step 6 is measured once)
    assert sorted(entry["step"] for entry in traced) == [2, 3, 4, 6]
    assert all(entry[TRACE_METRIC] > 0 and entry[TRACE_STDERR_METRIC] > 0 for entry in traced)
    assert sum(TRACE_METRIC in logs for logs in reporter.logs) == 4
    assert isinstance(trace.flatness_record, FlatnessRecord) and isinstance(trace.last_estimate, TraceEstimate)
    assert trace.last_estimate is trace.flatness_record.trace and trace.flatness_record.trace_step == 6
    assert trace.last_estimate.mean == traced[-1][TRACE_METRIC]
    assert trace.last_estimate.n_contexts == 6 and trace.last_estimate.n_draws == 2

    # identical training: same losses, same final weights, bit for bit (dropout and MLM masking use the global RNG)
    assert_training_unchanged(plain, measured)


def test_the_same_contexts_give_the_same_value_on_the_same_weights(tmp_path, tokenizer):
    trace = HessianTraceCallback(n_contexts=5, n_draws=2, on_evaluate=False)
    trainer = train_word_mlm(tmp_path, tokenizer, [trace])
    first, second = trace.measure(), trace.measure()
    assert first.mean == second.mean
    # the callback's own measurement at the last step saw the same weights and contexts
    logged = [e[TRACE_METRIC] for e in trainer.state.log_history if TRACE_METRIC in e]
    assert logged == [first.mean, first.mean, second.mean]


def test_the_budget_sizes_each_measurement_from_the_cost_of_the_previous_one():
    budget = dict(max_overhead=0.05, n_contexts=256, min_contexts=32)
    # the first measurement has no cost to go by: one batch, which measures it
    assert (
        contexts_within_budget(
            **budget, train_seconds=1.0, measuring_seconds=0.0, seconds_per_context=None, required=False
        )
        == 32
    )
    # 5% of 1000 s, less the 10 s spent, at 0.5 s per context
    assert (
        contexts_within_budget(
            **budget, train_seconds=1000.0, measuring_seconds=10.0, seconds_per_context=0.5, required=False
        )
        == 80
    )
    assert (
        contexts_within_budget(
            **budget, train_seconds=1e6, measuring_seconds=10.0, seconds_per_context=0.5, required=False
        )
        == 256
    )
    # 20 contexts fit, fewer than one batch: an optional measurement is skipped, a required one takes one batch
    tight = dict(train_seconds=400.0, measuring_seconds=10.0, seconds_per_context=0.5)
    assert contexts_within_budget(**budget, **tight, required=False) == 0
    assert contexts_within_budget(**budget, **tight, required=True) == 32
    over = dict(train_seconds=100.0, measuring_seconds=50.0, seconds_per_context=0.5)
    assert contexts_within_budget(**budget, **over, required=True) == 32


def test_a_spent_budget_skips_evaluation_measurements_but_not_the_last(tmp_path, tokenizer):
    # the final measurement sized by the budget too, as before full_final_measurement became the default
    trace = HessianTraceCallback(n_contexts=6, n_draws=2, batch_size=2, max_overhead=1e-9, full_final_measurement=False)
    trainer = train_word_mlm(tmp_path, tokenizer, [trace])
    # evaluations at steps 3 and 6: the first measures one batch (the cost is unknown), the second finds the budget
    # spent, the last step is measured anyway, on one batch
    assert [(e["step"], e["n_contexts"]) for e in trace.measurement_history] == [(3, 2), (6, 2)]
    logged = [e for e in trainer.state.log_history if TRACE_METRIC in e]
    assert [e["step"] for e in logged] == [3, 6]
    reference = estimate_hessian_trace(trainer.model, trace._contexts, n_contexts=2, n_draws=2, batch_size=2)
    assert logged[-1][TRACE_METRIC] == reference.mean and logged[-1][TRACE_STDERR_METRIC] == reference.stderr
    assert trace.last_estimate.n_contexts == 2

    generous = HessianTraceCallback(n_contexts=6, n_draws=2, batch_size=2, max_overhead=1e9)
    train_word_mlm(tmp_path / "generous", tokenizer, [generous])
    assert [e["n_contexts"] for e in generous.measurement_history] == [2, 6]


def test_full_final_measurement_takes_every_context_at_the_end_whatever_the_budget(tmp_path, tokenizer):
    trace = HessianTraceCallback(n_contexts=6, n_draws=2, batch_size=2, max_overhead=1e-9)  # full final: the default
    assert trace.config.full_final_measurement
    trainer = train_word_mlm(tmp_path, tokenizer, [trace])
    # the interim measurement follows the (spent) budget; the last one, on the card, takes all 6 contexts, once
    assert [(e["step"], e["n_contexts"]) for e in trace.measurement_history] == [(3, 2), (6, 6)]
    reference = estimate_hessian_trace(trainer.model, trace._contexts, n_contexts=6, n_draws=2, batch_size=2)
    assert (trace.last_estimate.mean, trace.last_estimate.n_contexts) == (reference.mean, 6)
    # a smaller measurement already taken on the final weights (an evaluation at the last step) is taken again whole
    trace.measurement_history = [{"step": 6, "n_contexts": 2, "seconds": 1.0}]
    assert trace._needs_full_final()
    with pytest.raises(ValueError, match="full_final_measurement must be True or False"):
        HessianTraceCallback(full_final_measurement="yes")


class _ManualClock:
    """Stands in for the `time` module of the callback: it moves only when a step or a measured context says so,
    so the budget's arithmetic has one right answer whatever the machine's load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _StepsTakeTime(TrainerCallback):
    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.now += self.seconds


@pytest.mark.parametrize(
    ("settings", "contexts_per_step"),
    [
        # 100 s per step, 1 s per context, 5%: the first measurement takes one batch (its cost unknown), then each
        # takes what is left of 5 s per step so far: 10 - 2 at step 2, then 5 a step; the final one takes all 24
        ({}, [2, 8, 5, 5, 5, 24]),
        ({"full_final_measurement": False}, [2, 8, 5, 5, 5, 5]),  # the final one sized like the others, as before
        ({"max_overhead": None}, [24] * 6),  # no budget: every context every time
    ],
)
def test_interim_measurements_fit_the_budget_and_the_final_one_takes_every_context(
    tmp_path, tokenizer, monkeypatch, settings, contexts_per_step
):
    from hf_flatbias.callbacks import trace as trace_module

    clock = _ManualClock()
    monkeypatch.setattr(trace_module, "time", clock)
    estimate = trace_module.estimate_hessian_trace

    def one_second_per_context(model, contexts, *, n_contexts, **options):
        clock.now += n_contexts
        return estimate(model, contexts, n_contexts=n_contexts, **options)

    monkeypatch.setattr(trace_module, "estimate_hessian_trace", one_second_per_context)
    trace = HessianTraceCallback(n_contexts=24, n_draws=1, batch_size=2, every_n_steps=1, on_evaluate=False, **settings)
    train_word_mlm(tmp_path, tokenizer, [_StepsTakeTime(clock, 100.0), trace])
    history = trace.measurement_history
    assert [(e["step"], e["n_contexts"]) for e in history] == list(enumerate(contexts_per_step, start=1))
    assert [e["seconds"] for e in history] == [float(n) for n in contexts_per_step]
    if settings.get("max_overhead", 0.05) is not None:  # the interim ones spent 5% of the 500 s before step 6
        assert sum(e["seconds"] for e in history[:-1]) <= 0.05 * 500
    assert trace.last_estimate.n_contexts == contexts_per_step[-1]


def test_flatbias_trainer_binds_the_callback_itself(tmp_path, tokenizer):
    trace = HessianTraceCallback(n_contexts=4, n_draws=1, on_evaluate=False, every_n_steps=6)
    trainer = train_word_mlm(tmp_path, tokenizer, [trace], trainer_class=FlatBiasTrainer, bind=False)
    assert [e["step"] for e in trainer.state.log_history if TRACE_METRIC in e] == [6]


def test_unbound_callback_says_how_to_bind(tmp_path, tokenizer):
    with pytest.raises(RuntimeError, match=r"bind_trainer\(trainer\)"):
        train_word_mlm(tmp_path, tokenizer, [HessianTraceCallback(n_contexts=2)], bind=False)


def test_bad_arguments_fail_before_training(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="n_draws"):
        HessianTraceCallback(n_draws=0)
    with pytest.raises(ValueError, match="every_n_steps"):
        HessianTraceCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="max_overhead"):
        HessianTraceCallback(max_overhead=0)
    small = word_mlm_tokenizer(MLM_WORDS[:3])
    callback = HessianTraceCallback(n_contexts=2)
    with pytest.raises(ValueError, match="do not belong together"):
        trainer = Trainer(
            model=word_mlm(small),
            args=TrainingArguments(str(tmp_path), report_to=[], use_cpu=True),
            eval_dataset=word_rows(tokenizer, 4, 0),
            processing_class=tokenizer,
        )
        callback.bind_trainer(trainer)
        callback.measure()


def test_keyword_settings_land_in_a_frozen_documented_config():
    callback = HessianTraceCallback(n_contexts=8, every_n_steps=3, also_measure="top_eigenvalue", max_overhead=None)
    assert callback.config == TraceCallbackConfig(
        n_contexts=8, every_n_steps=3, also_measure=("top_eigenvalue",), max_overhead=None
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        callback.config.n_contexts = 4
    assert all(field.metadata.get("help") for field in dataclasses.fields(TraceCallbackConfig))
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['n_context'\]"):
        HessianTraceCallback(n_context=8)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # a float used to pass and fail at the first measurement with "slice indices must be integers"
        ({"n_contexts": 2.5}, r"^n_contexts must be a whole number >= 1 \(got 2.5\); pass e.g. n_contexts=2.$"),
        ({"n_contexts": True}, r"^n_contexts must be a whole number >= 1 \(got True\)"),
        ({"batch_size": 4.0}, r"^batch_size must be a whole number >= 1 \(got 4.0\)"),
        ({"every_n_steps": False}, r"^every_n_steps must be a whole number >= 1 or None \(got False\)"),
        ({"n_draws": 2.0}, r"^n_draws must be a whole number >= 1"),
        ({"seed": 0.5}, r"^seed must be a whole number \(got 0.5\)"),
        ({"mask_token_id": 4.0}, r"^mask_token_id must be a whole number >= 0 or None"),
        ({"on_evaluate": 1}, r"^on_evaluate must be True or False \(got 1\)"),
        ({"max_overhead": True}, r"^max_overhead must be a number > 0"),
    ],
)
def test_wrong_types_are_refused_when_the_callback_is_made(arguments, message):
    with pytest.raises(ValueError, match=message):
        HessianTraceCallback(**arguments)


def test_interrupt_signals_are_taken_by_name_and_checked_when_made():
    assert SaveOnInterruptCallback(signals=("SIGINT", "sigterm")).signals == (signal.SIGINT, signal.SIGTERM)
    assert SaveOnInterruptCallback(signals=(signal.SIGINT, int(signal.SIGTERM))).signals == (
        signal.SIGINT,
        signal.SIGTERM,
    )
    assert SaveOnInterruptCallback().signals == (signal.SIGINT,)
    for bad in (("SIGNOPE",), (10**6,), ("SIGKILL",), (True,)):
        with pytest.raises(ValueError, match=r"^signals=.* is not a signal .*; pass names such as 'SIGINT'"):
            SaveOnInterruptCallback(signals=bad)
