"""Resuming refuses damaged or mismatched checkpoints with one sentence naming the file and the fix."""

import hashlib

import pytest
from transformers import BertConfig, BertForSequenceClassification

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.checkpoints import CheckpointError, checkpoint_problem, newest_intact_checkpoint
from tests.helpers.tiny_models import classification_rows, flatbias_config, tiny_classifier


def snapshot(folder):
    return {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def run(tmp_path):
    """A finished 2-step run with checkpoint-1 and checkpoint-2."""
    args = flatbias_config(tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=1)
    FlatBiasTrainer(model=tiny_classifier(), args=args, train_dataset=classification_rows()).train()
    return tmp_path / "run", args


def resume(args, model=None):
    trainer = FlatBiasTrainer(model=model or tiny_classifier(), args=args, train_dataset=classification_rows())
    trainer.train(resume_from_checkpoint=True)


def test_intact_checkpoints_pass(run):
    output, _ = run
    assert checkpoint_problem(output / "checkpoint-2") is None
    assert newest_intact_checkpoint(output) == output / "checkpoint-2"


@pytest.mark.parametrize(
    ("damaged", "damage"),
    [
        ("model.safetensors", lambda data: data[: len(data) // 2]),
        ("trainer_state.json", lambda data: data[: len(data) // 3]),
        ("config.json", lambda data: b"this is not json"),
    ],
)
def test_a_damaged_file_names_itself_and_the_previous_intact_checkpoint(run, damaged, damage):
    output, args = run
    path = output / "checkpoint-2" / damaged
    path.write_bytes(damage(path.read_bytes()))
    before = snapshot(output)
    with pytest.raises(CheckpointError) as raised:
        resume(args)
    message = str(raised.value)
    assert str(path) in message and str(output / "checkpoint-1") in message
    assert "\n" not in message
    assert snapshot(output) == before  # nothing written, nothing lost


def test_a_checkpoint_of_another_model_size_is_refused_before_loading(run):
    output, args = run
    bigger = tiny_classifier().config.to_dict()
    bigger.update(hidden_size=2 * bigger["hidden_size"], intermediate_size=2 * bigger["intermediate_size"])
    before = snapshot(output)
    with pytest.raises(CheckpointError, match="describes another model.*hidden_size") as raised:
        resume(args, BertForSequenceClassification(BertConfig(**bigger)))
    assert "new --output_dir" in str(raised.value)
    assert snapshot(output) == before


def test_resume_true_without_a_checkpoint_says_so(tmp_path):
    args = flatbias_config(tmp_path / "empty")
    with pytest.raises(ValueError, match="holds no checkpoint"):
        resume(args)


@pytest.mark.parametrize("missing", [True, "no-such-checkpoint"])
def test_a_missing_checkpoint_is_refused_in_transformers_words_then_the_hint(tmp_path, missing):
    """Issue 58, item 9: code that matches Trainer's message ("Can't find a valid checkpoint at ...", "No valid
    checkpoint found in output directory ...") must match FlatBiasTrainer's; the hint comes after those words."""
    from transformers import Trainer, TrainingArguments

    resume_from = str(tmp_path / missing) if isinstance(missing, str) else missing
    plain_args = TrainingArguments(tmp_path / "plain", report_to=[], use_cpu=True, max_steps=1)
    plain = Trainer(model=tiny_classifier(), args=plain_args, train_dataset=classification_rows())
    with pytest.raises(ValueError) as theirs:
        plain.train(resume_from_checkpoint=resume_from)
    args = flatbias_config(tmp_path / "plain")
    trainer = FlatBiasTrainer(model=tiny_classifier(), args=args, train_dataset=classification_rows())
    with pytest.raises(ValueError) as ours:
        trainer.train(resume_from_checkpoint=resume_from)
    assert str(ours.value).startswith(str(theirs.value)), (str(ours.value), str(theirs.value))
    hint = "start without resuming" if missing is True else "is not a folder"
    assert hint in str(ours.value) and "\n" not in str(ours.value)
