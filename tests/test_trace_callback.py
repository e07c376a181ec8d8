"""HessianTraceCallback inside real Trainer runs: logged values, no effect on training, binding."""

import pytest
import torch
from datasets import Dataset
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_flatbias.callbacks import TRACE_METRIC, TRACE_STDERR_METRIC, HessianTraceCallback
from hf_flatbias.flatness import TraceEstimate
from hf_flatbias.synthetic import make_tokenizer
from hf_flatbias.trainer import FlatBiasTrainer

WORDS = [f"w{i}" for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(WORDS, model_max_length=16)


def _data(tokenizer, n, seed):
    generator = torch.Generator().manual_seed(seed)
    texts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (8,), generator=generator)) for _ in range(n)]
    encoded = tokenizer(texts)
    return Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})


def _model(tokenizer):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        pad_token_id=tokenizer.pad_token_id,
        hidden_dropout_prob=0.1,
    )
    return BertForMaskedLM(config)


class _LogRecorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _train(tmp_path, tokenizer, callbacks, trainer_class=Trainer, bind=True):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to=[],
        seed=7,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    trainer = trainer_class(
        model=_model(tokenizer),
        args=args,
        train_dataset=_data(tokenizer, 24, 0),
        eval_dataset=_data(tokenizer, 8, 1),
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    if bind:
        for callback in callbacks:
            if hasattr(callback, "bind_trainer"):
                callback.bind_trainer(trainer)
    trainer.train()
    return trainer


def test_logged_values_reach_log_history_and_reporters_without_changing_training(tmp_path, tokenizer):
    plain = _train(tmp_path / "plain", tokenizer, [])
    trace = HessianTraceCallback(n_contexts=6, n_draws=2, every_n_steps=2)
    reporter = _LogRecorder()
    measured = _train(tmp_path / "measured", tokenizer, [trace, reporter])

    traced = [entry for entry in measured.state.log_history if TRACE_METRIC in entry]
    # every 2 steps (2, 4, 6) and after each evaluation (3, 6; step 6 is measured once)
    assert sorted(entry["step"] for entry in traced) == [2, 3, 4, 6]
    assert all(entry[TRACE_METRIC] > 0 and entry[TRACE_STDERR_METRIC] > 0 for entry in traced)
    assert sum(TRACE_METRIC in logs for logs in reporter.logs) == 4
    assert isinstance(trace.last_estimate, TraceEstimate)
    assert trace.last_estimate.mean == traced[-1][TRACE_METRIC]
    assert trace.last_estimate.n_contexts == 6 and trace.last_estimate.n_draws == 2

    # identical training: same losses, same final weights, bit for bit (dropout and MLM masking use the global RNG)
    def losses(trainer):
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    assert losses(plain) == losses(measured)
    for (name, p), q in zip(plain.model.named_parameters(), measured.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert measured.model.training == plain.model.training


def test_the_same_contexts_give_the_same_value_on_the_same_weights(tmp_path, tokenizer):
    trace = HessianTraceCallback(n_contexts=5, n_draws=2, on_evaluate=False)
    trainer = _train(tmp_path, tokenizer, [trace])
    first, second = trace.measure(), trace.measure()
    assert first.mean == second.mean
    # the callback's own measurement at the last step saw the same weights and contexts
    logged = [e[TRACE_METRIC] for e in trainer.state.log_history if TRACE_METRIC in e]
    assert logged == [first.mean, first.mean, second.mean]


def test_flatbias_trainer_binds_the_callback_itself(tmp_path, tokenizer):
    trace = HessianTraceCallback(n_contexts=4, n_draws=1, on_evaluate=False, every_n_steps=6)
    trainer = _train(tmp_path, tokenizer, [trace], trainer_class=FlatBiasTrainer, bind=False)
    assert [e["step"] for e in trainer.state.log_history if TRACE_METRIC in e] == [6]


def test_unbound_callback_says_how_to_bind(tmp_path, tokenizer):
    with pytest.raises(RuntimeError, match=r"bind_trainer\(trainer\)"):
        _train(tmp_path, tokenizer, [HessianTraceCallback(n_contexts=2)], bind=False)


def test_bad_arguments_fail_before_training(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="n_draws"):
        HessianTraceCallback(n_draws=0)
    with pytest.raises(ValueError, match="every_n_steps"):
        HessianTraceCallback(every_n_steps=0)
    small = make_tokenizer(WORDS[:3], model_max_length=16)
    callback = HessianTraceCallback(n_contexts=2)
    with pytest.raises(ValueError, match="do not belong together"):
        trainer = Trainer(
            model=_model(small),
            args=TrainingArguments(str(tmp_path), report_to=[], use_cpu=True),
            eval_dataset=_data(tokenizer, 4, 0),
            processing_class=tokenizer,
        )
        callback.bind_trainer(trainer)
        callback.measure()
