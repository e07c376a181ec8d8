"""Output-layer SAM with one trunk forward inside trl's SFT (fused LM head, no logits) and DPO (log-probabilities of
the concatenated chosen and rejected rows), against the two-forward plain-PyTorch SAM of `tests/test_logits_sam.py`
on the micro-batches trl's dataloader yields."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("trl")

from tests.helpers.tiny_models import word_tokenizer  # noqa: E402
from tests.helpers.trl_heads import head_paths_counted  # noqa: E402
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
# the step's head forms its gradients in the forward, in the model's dtype: 1e-12 in float64 (trl's own fused head is
# float32-accurate even in float64, 1e-8 from this reference)
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
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


#: How the policy's head runs in DPO's replayed step: every row's softmax - onehot kept to the backward (the default
#: budget), none kept (a budget below one chunk: the head's gradient recomputed in the backward), trl's fused head.
DPO_HEADS = {"kept": {}, "recomputed": {"sam_kept_softmax_mib": 1e-6}, "trl": {"sam_kept_softmax_mib": 0}}


@pytest.mark.parametrize("head", list(DPO_HEADS))
@pytest.mark.parametrize("live_reference", [False, True])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_dpo_runs_the_policy_trunk_once_and_matches_two_forward_sam(
    tmp_path, tokenizer, live_reference, accumulation, head
):
    trainer = dpo_trainer(
        tmp_path,
        tokenizer,
        live_reference=live_reference,
        per_device_train_batch_size=4 // accumulation,
        gradient_accumulation_steps=accumulation,
        **HEAD_SAM,
        **DPO_HEADS[head],
    )
    counter = CallCounter(trainer.model.model.layers[0])
    loss = dpo_loss_function(fresh_model(trainer).eval(), beta=0.5)
    reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), loss)
    with head_paths_counted() as calls:
        trainer.train()
    micro_batches = trainer.args.max_steps * accumulation
    assert counter.calls == micro_batches
    # the live reference model's log-probabilities: trl's head once per micro-batch
    reference_calls = micro_batches if live_reference else 0
    if head == "trl":
        assert calls == {
            "head_gradient_forwards": 0,
            "kept_bytes": [],
            "trl_kernel_calls": reference_calls + 2 * micro_batches,
        }
    else:
        budget = int(trainer.args.sam_kept_softmax_mib * 2**20)
        assert calls == {
            "head_gradient_forwards": 2 * micro_batches,
            "kept_bytes": [budget] * (2 * micro_batches),
            "trl_kernel_calls": reference_calls,
        }
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-6, difference
    assert max_param_diff(fresh_model(trainer), reference) > 1e-3


def test_dpo_logs_trls_metrics_from_the_kept_head_as_from_trls_head(tmp_path, tokenizer):
    """The first pass's head computes the fields trl's DPO metrics read (entropy, mean logit, top-1): a step with the
    rows kept logs what the step with trl's head logs, rewards and log-probabilities included."""

    def logged(path, head):
        trainer = dpo_trainer(path, tokenizer, live_reference=True, max_steps=1, **HEAD_SAM, **DPO_HEADS[head])
        trainer.train()
        (entry,) = [entry for entry in trainer.state.log_history if "loss" in entry]
        return entry

    kept, trl = logged(tmp_path / "kept", "kept"), logged(tmp_path / "trl", "trl")
    metrics = ["entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "num_tokens", "loss"]
    metrics += [f"rewards/{key}" for key in ("chosen", "rejected", "margins")] + ["logps/chosen", "logps/rejected"]
    for name in metrics:
        assert kept[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-6), name
    assert kept["logits/chosen"] != 0.0 and kept["entropy"] > 0


def completion_log_probs_in_model_dtype(model, batch):
    """`tests.test_trl.completion_log_probs` without its float32 cast: log p(completion | prompt) of every row."""
    log_probs = torch.log_softmax(next_token_logits(model, batch), -1)
    per_token = log_probs.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return (per_token * batch["completion_mask"][:, 1:]).sum(1)


def float64_dpo_trainer(path, tokenizer, **fields):
    """DPO of a fresh float64 `tiny_llama` with a live reference copy, 2 updates of 2 micro-batches of 2 pairs,
    output-layer SAM; ``fields`` are further config fields."""
    from hf_flatbias import FlatBiasDPOTrainer
    from tests.helpers.tiny_models import tiny_llama
    from tests.test_trl import dpo_config, preference_rows

    model = tiny_llama(len(tokenizer)).double()
    args = dpo_config(
        path,
        precompute_ref_log_probs=False,
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        **HEAD_SAM,
        **fields,
    )
    return FlatBiasDPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=preference_rows(),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("head", ["kept", "recomputed"])
def test_dpo_float64_step_with_the_head_formed_after_the_loss_equals_the_plain_reference(tmp_path, tokenizer, head):
    """Float64, 2 updates of 2 micro-batches, a live reference model (its log-probabilities from the full logits in
    float64): the step whose head keeps ``softmax - onehot`` to the backward (or recomputes it there) equals the
    plain two-forward SAM written from DPO's definition to 1e-12. The rows' weights differ in sign (chosen, rejected)
    and in each pair's sigmoid factor, so a kept row scaled by another row's weight, or by one shared factor, moves
    the perturbation (measured with a fault in the first pass only: its rows all scaled by their mean weight, 6.7e-3
    from the reference after 2 updates; each row by the previous row's weight, 3.3e-3; the float32 test above then
    misses by 4.6e-3 to 1.0e-2)."""
    from tests.helpers.distributed_sam_script import fused_head_in_model_dtype

    with fused_head_in_model_dtype():
        trainer = float64_dpo_trainer(tmp_path, tokenizer, **DPO_HEADS[head])
        frozen = fresh_model(trainer).eval()
        references: dict[int, tuple[dict, torch.Tensor]] = {}  # the batch kept alive: no other may reuse its id

        def loss(policy, batch, update):
            if id(batch) not in references:
                with torch.no_grad():
                    references[id(batch)] = (batch, completion_log_probs_in_model_dtype(frozen, batch))
            ratios = completion_log_probs_in_model_dtype(policy, batch) - references[id(batch)][1]
            chosen, rejected = ratios.chunk(2)
            return -torch.nn.functional.logsigmoid(0.5 * (chosen - rejected)).mean() / len(update)

        reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), loss)
        with head_paths_counted() as calls:
            trainer.train()
    # the policy's two passes through ours; trl's kernel for the reference's forward
    assert len(calls["kept_bytes"]) == 8 and calls["trl_kernel_calls"] == 4
    difference = max_param_diff(trainer.model, reference)
    assert difference < 1e-12, difference
    assert max_param_diff(fresh_model(trainer), reference) > 1e-3


def test_sft_logs_the_clean_pass_metrics_once_and_the_second_head_computes_none(tmp_path, tokenizer, monkeypatch):
    """trl's entropy and token accuracy logged at a step are the first pass's, at ``w``, from the full logits (a
    second pass's zeros or values at ``w + e`` averaged in would move them); both passes run the head that forms its
    gradients in the forward, not trl's kernel: the first without the hidden states' gradient and with the metrics,
    the second with that gradient and without them."""
    import trl.trainer.utils as trl_utils

    import hf_flatbias.integrations.trl_fused_head as integration

    kernel, asked, formed = trl_utils._ChunkedLogProbFunction, [], []

    def apply(*args):
        asked.append(args[-1])
        return kernel.apply(*args)

    def spy(hidden, weight, bias, labels, **kwargs):
        formed.append((kwargs["metrics"], hidden.requires_grad))
        return label_log_probs(hidden, weight, bias, labels, **kwargs)

    label_log_probs = integration.label_log_probs
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", type("Spy", (), {"apply": staticmethod(apply)}))
    monkeypatch.setattr(integration, "label_log_probs", spy)
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
    assert formed == [(True, False), (False, True)]
    assert asked == []


def test_sft_dft_loss_keeps_trls_head_says_why_and_matches_the_two_forward_step(tmp_path, tokenizer, caplog):
    """``loss_type="dft"`` weights each token by its probability: the step keeps trl's fused head (the gradient
    cannot be formed before the loss), says so once, and is the two-forward step of that head."""

    def run(path, replay):
        trainer = sft_trainer(path, tokenizer, "completion_only", dtype=torch.float64, loss_type="dft", **HEAD_SAM)
        if not replay:
            trainer.flatness_method.trunk_replay = lambda module: (None, 1.0)
        counter = CallCounter(trainer.model.model.layers[0])
        trainer.train()
        return trainer.model, counter.calls

    with caplog.at_level(logging.WARNING):
        replayed, calls = run(tmp_path / "a", True)
    said = [r.getMessage() for r in caplog.records if "loss_type='dft'" in r.getMessage()]
    assert len(said) == 1 and "recomputed in its backward" in said[0], said
    two_forward, calls_two = run(tmp_path / "b", False)
    assert (calls, calls_two) == (3, 6)
    assert max_param_diff(replayed, two_forward) < 1e-13


def test_sft_float64_step_equals_the_two_forward_step_of_the_same_head(tmp_path, tokenizer):
    def run(path, replay):
        trainer = sft_trainer(path, tokenizer, "completion_only", dtype=torch.float64, **HEAD_SAM)
        # the replay alone: both steps with trl's fused head (the replayed step's own head is checked above)
        trainer.head_gradients_in_forward = lambda: (None, None)
        if not replay:
            trainer.flatness_method.trunk_replay = lambda module: (None, 1.0)
        counter = CallCounter(trainer.model.model.layers[0])
        trainer.train()
        return trainer.model, counter.calls

    replayed, calls = run(tmp_path / "a", True)
    two_forward, calls_two = run(tmp_path / "b", False)
    assert (calls, calls_two) == (3, 6)
    assert max_param_diff(replayed, two_forward) < 1e-13


@pytest.mark.parametrize("pre_shifted", [False, True])
def test_sft_head_gradient_forward_equals_autograd_through_the_logits(pre_shifted):
    """`forward_with_head_gradients` against the model's own float64 logits: trl's SFT loss over
    ``num_items_in_batch`` (ignored labels left out), every parameter's gradient, the metric fields and the label mask;
    with labels shifted inside or given pre-shifted (context parallelism)."""
    from trl.trainer.utils import add_fused_lm_head

    from hf_flatbias.integrations.trl_fused_head import forward_with_head_gradients
    from tests.test_logits_sam import tiny_llama

    model = tiny_llama(torch.float64, tie_word_embeddings=False)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(2, 16, (3, 7), generator=g)
    labels = input_ids.masked_fill(torch.rand(3, 7, generator=g) < 0.3, -100)
    targets = labels[:, 1:] if not pre_shifted else torch.cat([labels[:, 1:], torch.full((3, 1), -100)], 1)
    label_args = {"shift_labels": targets} if pre_shifted else {"labels": labels}
    forward = forward_with_head_gradients(model, lambda: True)
    outputs = forward(input_ids=input_ids, fused_lm_head=True, num_items_in_batch=23, **label_args)
    grads = torch.autograd.grad(-outputs.log_probs.sum() / 23, list(model.parameters()))

    logits = model(input_ids=input_ids).logits  # fused_lm_head=False: the model's own forward
    logits = logits if pre_shifted else logits[:, :-1]
    mask = targets != -100
    log_p = torch.log_softmax(logits, -1)
    expected = log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    expected_grads = torch.autograd.grad(-expected.sum() / 23, list(model.parameters()))
    assert torch.equal(outputs.label_mask, mask)
    assert float((outputs.log_probs - expected).detach().abs().max()) < 1e-12
    assert float((outputs.loss - (-expected.sum() / 23)).detach().abs()) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(grads, expected_grads, strict=True)) < 1e-12
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    assert float((outputs.entropy - entropy).detach().abs().max()) < 1e-12
    assert torch.equal(outputs.is_top1, (log_p.argmax(-1) == targets) & mask)


@pytest.mark.parametrize(
    "loss",
    [{"loss_type": ["ipo"]}, {"loss_type": ["sigmoid_norm"]}, {"loss_type": ["sigmoid", "sft"]}, {"ld_alpha": 0.5}],
    ids=["ipo", "sigmoid_norm", "sigmoid+sft", "ld_alpha"],
)
def test_dpo_kept_head_equals_trls_head_for_other_losses_and_token_weights(tmp_path, tokenizer, loss):
    """The kept head takes each token's weight from the loss's own backward, so DPO's other losses (a squared
    margin, length-normalised margins, an added NLL on the chosen response) and LD-DPO's down-weighted verbose tokens
    train as with trl's own head: float64 (both heads exact there), 2 updates of 2 micro-batches, a live reference.
    Measured with a fault in the kept head's backward (every token's weight given the mean magnitude, its own sign):
    all four miss by 3.5e-3 to 6.6e-2."""
    from tests.helpers.distributed_sam_script import fused_head_in_model_dtype

    def trained(head):
        with fused_head_in_model_dtype(), head_paths_counted() as calls:
            trainer = float64_dpo_trainer(tmp_path / head, tokenizer, **DPO_HEADS[head], **loss)
            trainer.train()
        assert calls["head_gradient_forwards"] == (8 if head == "kept" else 0)
        return trainer.model, fresh_model(trainer)

    (kept, initial), (trls, _) = trained("kept"), trained("trl")
    assert max_param_diff(kept, trls) < 1e-12, max_param_diff(kept, trls)
    assert max_param_diff(initial.double(), trls) > 1e-3
