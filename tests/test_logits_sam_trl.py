"""Output-layer SAM with one trunk forward inside trl's SFT (fused LM head, no logits) and DPO (log-probabilities of
the concatenated chosen and rejected rows), against the two-forward plain-PyTorch SAM of `tests/test_logits_sam.py`
on the micro-batches trl's dataloader yields."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tests.helpers.tiny_models import word_tokenizer  # noqa: E402
from tests.test_logits_sam import CallCounter, max_param_diff, reference_head_sam_sgd  # noqa: E402
from tests.test_trl import (  # noqa: E402
    N_WORDS,
    SFT_CASES,
    dpo_loss_function,
    dpo_trainer,
    fresh_model,
    next_token_logits,
    sft_loss,
    sft_trainer,
    updates_of,
)

HEAD_SAM = dict(flatness_method="sam", sam_parameters="output_layer")


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(N_WORDS)


@pytest.mark.parametrize("case", ["completion_only", "packing"])
@pytest.mark.parametrize("accumulation", [1, 2])
# trl's fused head returns float32-accurate log-probabilities even in float64 (1e-8 from the float64 reference here):
# in float64 the reference is held to 1e-7, and the step to the two-forward step of the same head to 1e-13 (below)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-7)])
def test_sft_runs_the_trunk_once_and_matches_two_forward_sam(tmp_path, tokenizer, case, accumulation, dtype, tolerance):
    batch_size = SFT_CASES[case][1].get("per_device_train_batch_size", 4) // accumulation
    trainer = sft_trainer(
        tmp_path,
        tokenizer,
        case,
        dtype=dtype,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        **HEAD_SAM,
    )
    counter = CallCounter(trainer.model.model.layers[0])
    reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), sft_loss)
    trainer.train()
    assert counter.calls == trainer.args.max_steps * accumulation, "one trunk forward per micro-batch"
    difference = max_param_diff(trainer.model, reference)
    assert difference < tolerance, difference
    assert max_param_diff(fresh_model(trainer), reference) > 1e-3


@pytest.mark.parametrize("live_reference", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_dpo_runs_the_policy_trunk_once_and_matches_two_forward_sam(tmp_path, tokenizer, live_reference, accumulation):
    trainer = dpo_trainer(
        tmp_path,
        tokenizer,
        live_reference=live_reference,
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
        **HEAD_SAM,
    )
    counter = CallCounter(trainer.model.model.layers[0])
    loss = dpo_loss_function(fresh_model(trainer).eval(), beta=0.5)
    reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), loss)
    trainer.train()
    assert counter.calls == trainer.args.max_steps * accumulation
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(fresh_model(trainer), reference) > 1e-3


def test_sft_logs_the_clean_pass_metrics_once_and_the_second_head_computes_none(tmp_path, tokenizer, monkeypatch):
    """trl's entropy and token accuracy logged at a step are the first pass's, at ``w``, from the full logits (a
    second pass's zeros or values at ``w + e`` averaged in would move them), and the second pass's fused head is asked
    for the log-probabilities only."""
    import trl.trainer.utils as trl_utils

    kernel, asked = trl_utils._ChunkedLogProbFunction, []

    def apply(*args):
        asked.append(args[-1])
        return kernel.apply(*args)

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", type("Spy", (), {"apply": staticmethod(apply)}))
    trainer = sft_trainer(tmp_path, tokenizer, "completion_only", max_steps=1, logging_steps=1, **HEAD_SAM)
    (batch,) = updates_of(trainer)[0]
    with torch.no_grad():
        log_p = torch.log_softmax(next_token_logits(fresh_model(trainer), batch).double(), -1)
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    entropy = -(log_p.exp() * log_p).sum(-1)[mask].mean().item()
    accuracy = (log_p.argmax(-1) == labels)[mask].double().mean().item()
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged["entropy"] == pytest.approx(entropy, abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert logged["num_tokens"] == batch["attention_mask"].sum().item()
    assert asked == [("log_probs", "entropy", "is_top1"), ("log_probs",)]


def test_sft_float64_step_equals_the_two_forward_step_of_the_same_head(tmp_path, tokenizer):
    def run(path, replay):
        trainer = sft_trainer(path, tokenizer, "completion_only", dtype=torch.float64, **HEAD_SAM)
        if not replay:
            trainer.flatness_method.trunk_replay = lambda module: (None, 1.0)
        counter = CallCounter(trainer.model.model.layers[0])
        trainer.train()
        return trainer.model, counter.calls

    replayed, calls = run(tmp_path / "a", True)
    two_forward, calls_two = run(tmp_path / "b", False)
    assert (calls, calls_two) == (3, 6)
    assert max_param_diff(replayed, two_forward) < 1e-13
