"""The adversarial pre-training objective of `hf_flatbias.adversarial`: the adversary on the evaluated read-out
(fixed-width concatenated features, one head per task, unmasked input), then the single-task ``[CLS]`` adversary:
its loss, each player's gradient, its checks."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_flatbias.adversarial import AdversarialPretrainingModel, confusion_loss
from hf_flatbias.probe import extract_features
from tests.helpers.tiny_models import tiny_mlm

WIDTH = 9


def masked_batch(seed=0):
    """Six rows of 4-7 tokens, padded to 7, one masked word each, and labels of three tasks (some missing: -1)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 6, 4, 7, 5])
    clean = torch.randint(5, 23, (6, 7), generator=generator)
    attention_mask = (torch.arange(7)[None] < lengths[:, None]).long()
    clean = clean * attention_mask  # padding id 0
    labels = torch.full_like(clean, -100)
    labels[:, 2] = clean[:, 2]
    input_ids = clean.clone()
    input_ids[:, 2] = 4
    task_labels = torch.tensor([[0, 1, 2], [1, 0, 0], [2, -1, 1], [1, 1, -1], [-1, 0, 2], [0, 1, 1]])
    return clean, dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, task_labels=task_labels)


def test_concat_features_are_the_probes_fixed_width_read_out():
    model = tiny_mlm()
    clean, batch = masked_batch()
    wrapper = AdversarialPretrainingModel(model, [3, 2, 3], pooling="concat", width=WIDTH, read_unmasked=True)
    with torch.no_grad():
        hidden = model(input_ids=clean, attention_mask=batch["attention_mask"], output_hidden_states=True)
        ours = wrapper.pooled_features(hidden.hidden_states[-1], batch["attention_mask"]).numpy()
    rows = [row[: int(n)].tolist() for row, n in zip(clean, batch["attention_mask"].sum(1), strict=True)]
    probe = extract_features(model, rows, pooling="concat", width=WIDTH)
    assert ours.shape == (6, 16 * WIDTH)
    np.testing.assert_allclose(ours, probe, atol=1e-5)


def test_each_task_head_and_the_encoder_get_their_own_objectives_on_unmasked_input():
    """Written out by hand: heads fit CE on detached clean-input features; the encoder gets MLM + lambda * the sum of
    the tasks' confusion terms; rows with a negative label leave that task's terms."""
    weight = 0.5
    wrapper = AdversarialPretrainingModel(
        tiny_mlm(), [3, 2, 3], adversary_weight=weight, pooling="concat", width=WIDTH, read_unmasked=True
    )
    clean, batch = masked_batch()
    out = wrapper(**batch)
    out.loss.backward()

    reference = tiny_mlm()
    reference.load_state_dict(wrapper.model.state_dict())
    heads = [torch.nn.Linear(16 * WIDTH, n) for n in (3, 2, 3)]
    for head, theirs in zip(heads, wrapper.heads, strict=True):
        head.load_state_dict(theirs.state_dict())
    mlm = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    hidden = reference(input_ids=clean, attention_mask=batch["attention_mask"], output_hidden_states=True)
    states = hidden.hidden_states[-1] * batch["attention_mask"][..., None]
    features = F.pad(states, (0, 0, 0, WIDTH - 7)).flatten(1)
    head_loss, confusion = 0.0, 0.0
    for task, head in enumerate(heads):
        keep = batch["task_labels"][:, task] >= 0
        head_loss = head_loss + F.cross_entropy(head(features[keep].detach()), batch["task_labels"][keep, task])
        frozen = F.linear(features[keep], head.weight.detach(), head.bias.detach())
        confusion = confusion + confusion_loss(frozen)
    (mlm + weight * confusion + head_loss).backward()

    torch.testing.assert_close(out.mlm_loss, mlm.detach())
    torch.testing.assert_close(out.confusion_loss, confusion.detach())
    for head, theirs in zip(heads, wrapper.heads, strict=True):
        torch.testing.assert_close(theirs.weight.grad, head.weight.grad)
    for (name, p), q in zip(wrapper.model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_masked_input_is_read_without_read_unmasked():
    wrapper = AdversarialPretrainingModel(tiny_mlm(), [3, 2, 3], pooling="concat", width=WIDTH)
    unmasked = AdversarialPretrainingModel(tiny_mlm(), [3, 2, 3], pooling="concat", width=WIDTH, read_unmasked=True)
    _, batch = masked_batch()
    assert wrapper(**batch).confusion_loss != unmasked(**batch).confusion_loss


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_classes=[3, 1]), "at least 2 classes"),
        (dict(n_classes=3, pooling="concat"), "needs a width"),
        (dict(n_classes=3, width=4), "needs a width"),
        (dict(n_classes=3, pooling="max"), "not supported"),
    ],
)
def test_bad_settings_are_refused_before_training(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdversarialPretrainingModel(tiny_mlm(), **kwargs)


def test_wrong_number_of_task_columns_and_too_wide_batches_are_refused():
    _, batch = masked_batch()
    with pytest.raises(ValueError, match="3 tasks but the adversary has 2 heads"):
        AdversarialPretrainingModel(tiny_mlm(), [3, 2])(**batch)
    with pytest.raises(ValueError, match="wider than the adversary's width 5"):
        AdversarialPretrainingModel(tiny_mlm(), [3, 2, 3], pooling="concat", width=5)(**batch)


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 23, (6, 7), generator=generator)
    labels = torch.full_like(input_ids, -100)
    labels[:, 3] = input_ids[:, 3]
    input_ids[:, 3] = 4
    task_labels = torch.tensor([0, 1, 2, 1, -1, 0])
    return dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels, task_labels=task_labels)


def test_confusion_loss_is_cross_entropy_to_uniform():
    uniform = torch.zeros(4, 3)
    assert confusion_loss(uniform).item() == pytest.approx(math.log(3))
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    log_probs = torch.log(torch.softmax(logits, dim=-1))
    reference = -(log_probs.sum(dim=-1) / 3).mean()
    assert confusion_loss(logits).item() == pytest.approx(reference.item(), rel=1e-6)
    assert confusion_loss(logits).item() > math.log(3)


def test_each_player_gets_only_its_own_gradient():
    """Head: gradient of CE on detached features only. Encoder: gradient of MLM + lambda * confusion only."""
    weight = 0.7
    wrapper = AdversarialPretrainingModel(tiny_mlm(), n_classes=3, adversary_weight=weight)
    inputs = batch()
    wrapper(**inputs).loss.backward()
    head_grad = wrapper.adversary.weight.grad.clone()
    encoder_grads = {n: p.grad.clone() for n, p in wrapper.model.named_parameters() if p.grad is not None}

    # Independent reference: the two objectives written out separately on fresh copies.
    reference = tiny_mlm()
    reference.load_state_dict(wrapper.model.state_dict())
    head = torch.nn.Linear(16, 3)
    head.load_state_dict(wrapper.adversary.state_dict())
    keep = inputs["task_labels"] >= 0
    out = reference(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        labels=inputs["labels"],
        output_hidden_states=True,
    )
    cls = out.hidden_states[-1][:, 0][keep]
    F.cross_entropy(head(cls.detach()), inputs["task_labels"][keep]).backward(retain_graph=True)
    torch.testing.assert_close(head_grad, head.weight.grad)
    with torch.no_grad():
        frozen = head.weight.clone(), head.bias.clone()
    probs_log = F.log_softmax(cls @ frozen[0].T + frozen[1], dim=-1)
    encoder_objective = out.loss + weight * (-probs_log.mean())
    reference.zero_grad()
    encoder_objective.backward()
    for name, parameter in reference.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(encoder_grads[name], parameter.grad, msg=name)


def test_zero_weight_trains_the_encoder_like_plain_mlm():
    wrapper = AdversarialPretrainingModel(tiny_mlm(), n_classes=3, adversary_weight=0.0)
    plain = tiny_mlm()
    inputs = batch(seed=3)
    wrapper(**inputs).loss.backward()
    plain(**{k: v for k, v in inputs.items() if k != "task_labels"}).loss.backward()
    for (name, got), (_, expected) in zip(wrapper.model.named_parameters(), plain.named_parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_classes": 1}, "at least 2 classes"),
        ({"n_classes": 3, "adversary_weight": -1}, ">= 0"),
        ({"n_classes": 3, "pooling": "max"}, "pooling='max'"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdversarialPretrainingModel(tiny_mlm(), **kwargs)


def test_the_trainer_checkpoints_a_wrapped_masked_lm_and_resumes_it_exactly(tmp_path):
    """The wrapper is not a `PreTrainedModel`, so the Trainer saves its bare state dict, which safetensors refused
    while the decoder shares the word embeddings; saved with one name per tensor, a resume continues the run exactly
    and the decoder stays tied."""
    from datasets import Dataset
    from transformers import default_data_collator

    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer

    _, batch = masked_batch()
    rows = Dataset.from_dict({key: value.tolist() for key, value in batch.items()})

    def trainer(output_dir, steps):
        torch.manual_seed(0)
        wrapper = AdversarialPretrainingModel(tiny_mlm(), [3, 2, 3], adversary_weight=0.5, pooling="concat", width=7)
        args = FlatBiasConfig(
            str(output_dir), max_steps=steps, per_device_train_batch_size=3, learning_rate=1e-2, save_steps=1,
            report_to=[], use_cpu=True, flatness_method="sam", sam_rho=0.05, seed=0, disable_tqdm=True,
        )  # fmt: skip
        return FlatBiasTrainer(model=wrapper, args=args, train_dataset=rows, data_collator=default_data_collator)

    whole = trainer(tmp_path / "whole", 3)
    whole.train()
    stopped = trainer(tmp_path / "stopped", 3)
    stopped.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    for (name, ours), theirs in zip(stopped.model.state_dict().items(), whole.model.state_dict().values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    inner = stopped.model.model
    assert inner.cls.predictions.decoder.weight is inner.get_input_embeddings().weight
